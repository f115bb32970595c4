//! Certificates for a job: a CA (`DIR/ca.pem`) and, for each NAME, a
//! certificate `DIR/NAME.pem` and key `DIR/NAME.key` signed by it. Every
//! process of the job gets the CA and one certificate; only holders of a
//! certificate from this CA can talk to the job (mutual TLS).
//!
//!     cargo run --release --example certs -- certs master ps trainer
//!
//! For production, use your own CA; the files are plain PEM.

use oar::transport::DevCa;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(dir), names) = (args.next(), args.collect::<Vec<_>>()) else {
        eprintln!("usage: certs DIR NAME...");
        return ExitCode::from(2);
    };
    if names.is_empty() || dir.starts_with('-') {
        eprintln!("usage: certs DIR NAME...  (at least one NAME)");
        return ExitCode::from(2);
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    match DevCa::new().and_then(|ca| ca.write_files(&dir, &names)) {
        Ok(paths) => {
            for path in paths {
                println!("{}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
