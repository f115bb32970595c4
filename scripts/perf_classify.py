#!/usr/bin/env python3
# Classify perf script samples (with call chains) into cost categories.
import sys, re, collections
def frames_of(block):
    fr = []
    for l in block[1:]:
        l = l.strip()
        m = re.match(r'^[0-9a-f]+\s+(.*?)\s+\((.*)\)$', l)
        if m: fr.append((m.group(1), m.group(2)))
    return fr
def has(fr, *pats):
    return any(any(p in s for p in pats) for s, _ in fr)
def first_user(fr, skip=('memmove','memcpy','memset','malloc','free','_int_','sysmalloc','realloc','cfree','unknown','alloc::','core::ptr','__rust','bytes::bytes_mut','extend_from_slice','<alloc','<bytes','copy_from_slice','copy_nonoverlapping','spec_extend','reserve','with_capacity')):
    for s, d in fr:
        if '[kernel' in d: continue
        if any(k in s for k in skip): continue
        return s
    return '?'
def ctx(fr, n=25):
    return ' | '.join(s for s, d in fr if '[kernel' not in d)[:6000][:4000]
def user_site(fr):
    c = ctx(fr)
    if 'RecvState::poll_socket' in c and ('From<&[u8]>' in c or 'to_vec' in c): return 'quinn endpoint: datagram copied into a fresh BytesMut'
    if 'feed' in c and ('read_frame' in c or 'serve_stream' in c or 'Decoder' in c or 'wire' in c): return 'oar Decoder::feed: chunk -> frame buffer'
    if 'write_stream_frames' in c or 'SendBuffer' in c or 'poll_transmit' in c: return 'quinn-proto send: stream data -> packet'
    if 'Assembler' in c or 'defragment' in c: return 'quinn-proto receive reassembly'
    return None
def classify(fr):
    if not fr: return 'unknown'
    leaf, dso = fr[0]
    syms = [s for s, _ in fr]
    # kernel side first (scan the stack for the entry point)
    if has(fr, 'asm_exc_page_fault'):
        u = user_site(fr)
        return 'page faults: ' + (u or first_user(fr)[:60])
    if has(fr, '__x64_sys_munmap'): return 'munmap (freeing the 256 MiB frame buffer)'
    if has(fr, '__x64_sys_madvise'): return 'madvise (glibc arena trim)'
    if has(fr, '__x64_sys_brk', '__x64_sys_mmap', '__x64_sys_mprotect'): return 'mmap/brk/mprotect'
    if has(fr, 'udp_sendmsg', '__sys_sendmsg', '__x64_sys_sendmsg', '__x64_sys_sendmmsg'): return 'UDP send syscall (sendmsg)'
    if has(fr, 'udp_recvmsg', '__x64_sys_recvmmsg', '__x64_sys_recvmsg', '__x64_sys_recvfrom'): return 'UDP recv syscall (recvmsg/recvmmsg)'
    if has(fr, 'tcp_sendmsg', 'tcp_recvmsg', '__x64_sys_write', '__x64_sys_read', '__x64_sys_sendto'): return 'TCP syscalls'
    if has(fr, '__x64_sys_futex'): return 'futex (thread park/unpark)'
    if has(fr, '__x64_sys_epoll_wait', '__x64_sys_epoll_pwait'): return 'epoll_wait'
    if has(fr, 'entry_SYSCALL_64'): return 'other syscalls'
    if '[kernel' in dso: return 'kernel other (irq, softirq, sched)'
    # user space
    if any(k in leaf for k in ('ring_core', 'aes_gcm', 'gcm_', 'ghash', 'chacha', 'poly1305', 'aes_hw', 'aesni')) or has(fr[:3], 'ring::aead'):
        return 'crypto (ring AES-GCM)'
    if 'memmove' in leaf or 'memcpy' in leaf or 'memset' in leaf:
        u = user_site(fr)
        return 'memcpy: ' + (u or first_user(fr)[:70])
    if any(k in leaf for k in ('malloc', 'free', '_int_', 'sysmalloc', 'realloc', 'tcache')): return 'malloc/free'
    if has(fr[:1], 'quinn_proto') : return 'quinn-proto packet work'
    if has(fr[:1], 'quinn_udp'): return 'quinn-udp (socket glue)'
    if has(fr[:1], 'quinn::'): return 'quinn (async glue)'
    if has(fr[:1], 'tokio::'): return 'tokio runtime'
    if has(fr[:1], 'oar_transport', 'oarprof'): return 'oar layer'
    if has(fr[:1], 'rustls'): return 'rustls'
    if 'vdso' in dso: return 'clock_gettime (vdso)'
    return 'user other (%s)' % leaf[:60]
blocks, cur = [], []
for line in sys.stdin:
    if line.strip() == '':
        if cur: blocks.append(cur); cur = []
    else: cur.append(line.rstrip('\n'))
if cur: blocks.append(cur)
c = collections.Counter()
for b in blocks: c[classify(frames_of(b))] += 1
tot = sum(c.values())
print('samples', tot)
for k, v in c.most_common():
    if v / tot >= 0.003: print('%6.1f%%  %s' % (100 * v / tot, k))
