//! The output commands against a reader that goes away (`proxy-agent dump --view | head`):
//! the real binary, a stand-in for an agent's debug endpoint on loopback, and a pipe
//! closed early. `println!` panicked on the broken pipe (status 101); the commands now
//! end quietly with status 0, as `head` expects. No root needed.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// Serves `/debug/view` (a view of 5,000 frontends: far more than a pipe holds),
/// `/debug/model` (as large) and `/debug/watch` (a line every 10 ms, for ever), as an
/// agent's debug endpoint does, on a free loopback port.
fn debug_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let view: Vec<serde_json::Value> = (0..5000)
        .map(|i| {
            serde_json::json!({
                "frontend": format!("10.96.{}.{}:80/TCP", i / 250, i % 250),
                "state": {"kind": "ClusterIp", "service": format!("default/s{i}:http"),
                          "backends": {"endpoints": ["10.244.1.5:8080"], "when_empty": "Reject"}},
            })
        })
        .collect();
    let view = serde_json::to_string(&view).expect("json");
    let model = serde_json::json!({"services": view, "endpointSlices": []}).to_string();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let (view, model) = (view.clone(), model.clone());
            thread::spawn(move || answer(conn, &view, &model));
        }
    });
    addr
}

fn answer(mut conn: TcpStream, view: &str, model: &str) {
    let mut request = String::new();
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    // The request's lines, up to the blank one.
    while reader.read_line(&mut request).is_ok_and(|n| n > 2) {}
    let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
    let body = match path.as_str() {
        "/debug/view" => view,
        "/debug/model" => model,
        "/debug/watch" => {
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n",
            );
            for i in 0.. {
                let line = format!("+ 10.96.0.{}:80/TCP ClusterIp default/web:http\n", i % 250);
                let chunk = format!("{:x}\r\n{line}\r\n", line.len());
                if conn.write_all(chunk.as_bytes()).is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(10));
            }
            return;
        }
        _ => {
            let _ = conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
            return;
        }
    };
    let _ = conn.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
}

/// The binary under test: `PROXY_AGENT_BIN` (as `cargo xtask test` sets it), else this
/// package's.
fn agent_bin() -> std::path::PathBuf {
    std::env::var_os("PROXY_AGENT_BIN")
        .map_or_else(|| env!("CARGO_BIN_EXE_proxy-agent").into(), Into::into)
}

/// Starts `proxy-agent ARGS` with stdout and stderr piped and reads `lines` lines of its
/// output (0: none); the child and the reader, to go on or go away.
fn started(args: &[&str], lines: usize) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child: Child = Command::new(agent_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("proxy-agent");
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    for _ in 0..lines {
        let mut line = String::new();
        reader.read_line(&mut line).expect("a line");
        assert!(!line.is_empty(), "{args:?}: output ended early");
    }
    (child, reader)
}

/// Runs `proxy-agent ARGS` with its stdout piped; the reader reads `lines` lines (0: none)
/// and goes away. Returns the exit status's code and stderr, failing past 20 s.
fn closed_early(args: &[&str], lines: usize) -> (Option<i32>, String) {
    let (mut child, reader) = started(args, lines);
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?}: still running 20 s after its reader went away");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut err);
    }
    (status.code(), err)
}

#[test]
fn output_commands_end_quietly_when_their_reader_goes_away() {
    let addr = debug_endpoint();
    for (args, lines) in [
        // `dump --view | head -1`: the header read, 5,000 rows to go.
        (vec!["dump", "--view", "--debug-addr", &addr], 1),
        (vec!["dump", "--view", "--json", "--debug-addr", &addr], 0),
        (vec!["dump", "--model", "--debug-addr", &addr], 0),
        // `watch | head -3`: the stream goes on after the reader left.
        (vec!["watch", "--debug-addr", &addr], 3),
    ] {
        let (code, err) = closed_early(&args, lines);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Error"), "{args:?}: {err}");
    }
}

/// A reader that stays to the end gets everything: the quiet exit is only for a pipe
/// that was closed.
#[test]
fn output_commands_still_print_everything_to_a_reader_that_stays() {
    let addr = debug_endpoint();
    let out = Command::new(agent_bin())
        .args(["dump", "--view", "--debug-addr", &addr])
        .output()
        .expect("proxy-agent");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 5001, "a header and 5,000 rows");
    assert!(
        text.lines()
            .last()
            .is_some_and(|l| l.contains("default/s4999:http"))
    );
}

/// jemalloc runs with its background thread (the binary's embedded options): freed pages
/// go back to the system on time, not only when the process allocates again, so an
/// idle agent's RSS is what it holds (an agent idle after its first programming of 100k
/// Services showed 285 MiB, 235 MiB with the thread). Seen in the process's threads.
#[test]
fn the_allocator_gives_memory_back_from_a_background_thread() {
    let addr = debug_endpoint();
    let (mut child, _reader) = started(&["watch", "--debug-addr", &addr], 1);
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", child.id()))
        .expect("the agent's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        threads.iter().any(|t| t.starts_with("jemalloc_bg_thd")),
        "no jemalloc background thread among {threads:?}"
    );
}
