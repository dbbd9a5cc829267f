//! GET from an agent's HTTP server inside a network namespace.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use crate::pods::run_in;

/// GET `path` from `addr` inside `netns`: (status code, body); `None` when nothing answers.
pub fn get(netns: &str, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: weir\r\nConnection: close\r\n\r\n");
    run_in(netns, move || {
        let mut s = std::net::TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(request.as_bytes()).ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let code = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Some((code, body))
    })
}
