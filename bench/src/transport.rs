//! The raw-TCP reference the transport examples measure QUIC against.

use bytes::BytesMut;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// A TCP server. A connection starts with its mode: 0, 16-byte echoes until
/// it closes; 1, length-prefixed bulk messages each received into a fresh
/// buffer allocated at the declared size (as the QUIC receiver does) and
/// answered by one byte; 2, the same into one reused buffer (raw TCP's
/// ceiling: no allocation, no page faults).
pub async fn tcp_server(listener: TcpListener) {
    while let Ok((mut s, _)) = listener.accept().await {
        let _ = s.set_nodelay(true);
        tokio::spawn(async move {
            let Ok(mode) = s.read_u64_le().await else { return };
            if mode == 0 {
                let mut b = [0u8; 16];
                while s.read_exact(&mut b).await.is_ok() {
                    if s.write_all(&b).await.is_err() {
                        return;
                    }
                }
                return;
            }
            let mut reused = Vec::new();
            loop {
                let Ok(len) = s.read_u64_le().await else { return };
                let len = len as usize;
                if mode == 1 {
                    let mut buf = BytesMut::with_capacity(len);
                    while buf.len() < len {
                        match s.read_buf(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                    }
                    std::hint::black_box(buf.freeze());
                } else {
                    reused.resize(len, 0u8);
                    if s.read_exact(&mut reused).await.is_err() {
                        return;
                    }
                    std::hint::black_box(&reused);
                }
                if s.write_all(&[1]).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// A TCP_NODELAY connection to a [`tcp_server`] in `mode` (its first 8 bytes).
pub async fn tcp_connect(addr: std::net::SocketAddr, mode: u64) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_u64_le(mode).await?;
    Ok(s)
}
