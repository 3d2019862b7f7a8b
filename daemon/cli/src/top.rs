//! `weightstream top`: a live view of the daemon's devices and sessions, refreshed from
//! `ListSessions`. Rates (GB/s, GPU wait %, acquire pending %, hit rate) are over the last
//! refresh interval, so they show what is happening now rather than since the session opened.
//! The passes table splits each session's figures by pass kind (training, sampling).
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table};
use tokio::sync::mpsc;
use weightstream_client::{Client, ResolvedSocket, proto};

use super::{CliResult, Deadline, UsageError, human, shown};

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// Refresh interval in milliseconds (100 to 60000); with --once, how long the rates are
    /// measured over.
    #[arg(long, env = "WEIGHTSTREAM_TOP_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(100..=60_000))]
    interval_ms: u64,
    /// Samples of history kept per device (the sparkline's width; 2 to 10000).
    #[arg(long, env = "WEIGHTSTREAM_TOP_HISTORY", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(2..=10_000))]
    history: u64,
    /// Print the devices and sessions once as plain lines (the same figures, rates over one
    /// --interval-ms) and exit: for scripts, logs and pipes; needs no terminal.
    #[arg(long)]
    once: bool,
}

/// What `top` without --once says when its output is not a terminal.
pub const NEEDS_TERMINAL: &str =
    "weightstream top needs a terminal; use `weightstream top --once` for plain output";

/// Rates of one session over the last interval.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rates {
    pub bytes_per_s: f64,
    /// Fraction of the interval the client's compute waited for weights, as the client
    /// reports it; None from a client that does not report it.
    pub gpu_wait: Option<f64>,
    /// Fraction of the interval with an acquire (look-ahead ones included) pending in the
    /// daemon.
    pub acquire_pending: f64,
    /// Hits over acquires in the interval; None when it made no acquire.
    pub hit_rate: Option<f64>,
    /// The same figures per pass kind the session has acquired for, in the daemon's order.
    pub kinds: Vec<KindRates>,
}

/// One pass kind's rates over the last interval.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KindRates {
    pub kind: &'static str,
    pub bytes_per_s: f64,
    /// Fraction of the interval the client's compute waited for weights while this kind's
    /// passes ran; None from a client that does not report it.
    pub gpu_wait: Option<f64>,
    pub hit_rate: Option<f64>,
    /// Acquires and bytes copied since the session opened.
    pub acquires: u64,
    pub bytes_copied: u64,
}

fn kind_name(kind: proto::PassKind) -> &'static str {
    match kind {
        proto::PassKind::Train => "train",
        proto::PassKind::Sample => "sample",
        proto::PassKind::Unspecified => "unspecified",
    }
}

/// Counter deltas over `secs` as rates.
pub fn rates(before: &proto::SessionStats, now: &proto::SessionStats, secs: f64) -> Rates {
    let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
    let acquires = d(before.acquires, now.acquires);
    let fraction = |a: u64, b: u64| (d(a, b) / 1e9 / secs).min(1.0);
    let reports = now.gpu_wait_reports > 0;
    let kinds = (now.kinds.iter())
        .filter(|k| k.acquires > 0)
        .map(|k| {
            let zero = proto::PassStats::default();
            let b = (before.kinds.iter())
                .find(|b| b.kind == k.kind)
                .unwrap_or(&zero);
            let acquires = d(b.acquires, k.acquires);
            KindRates {
                kind: kind_name(k.kind()),
                bytes_per_s: d(b.bytes_copied, k.bytes_copied) / secs,
                gpu_wait: reports.then(|| fraction(b.gpu_wait_ns, k.gpu_wait_ns)),
                hit_rate: (acquires > 0.0).then(|| d(b.hits, k.hits) / acquires),
                acquires: k.acquires,
                bytes_copied: k.bytes_copied,
            }
        })
        .collect();
    Rates {
        bytes_per_s: d(before.bytes_copied, now.bytes_copied) / secs,
        gpu_wait: reports.then(|| fraction(before.gpu_wait_ns, now.gpu_wait_ns)),
        acquire_pending: fraction(before.acquire_pending_ns, now.acquire_pending_ns),
        hit_rate: (acquires > 0.0).then(|| d(before.hits, now.hits) / acquires),
        kinds,
    }
}

/// What the screen shows.
#[derive(Default)]
pub struct View {
    pub socket: String,
    pub backend: String,
    pub devices: Vec<proto::Device>,
    pub sessions: Vec<(proto::SessionInfo, Rates)>,
    /// Per device UUID: GB/s samples, oldest first, in MB/s for the sparkline.
    pub history: HashMap<String, VecDeque<u64>>,
    pub error: Option<String>,
}

/// Polls the daemon and keeps the previous sample for rates.
struct Poller {
    client: Option<Client>,
    socket: ResolvedSocket,
    previous: HashMap<String, proto::SessionStats>,
    at: Instant,
    history: usize,
    deadline: Deadline,
}

impl Poller {
    async fn refresh(&mut self, view: &mut View) {
        if self.client.is_none() {
            let connect = Client::connect_to(self.socket.clone());
            match self.deadline.on("connecting", connect).await {
                Ok(c) => self.client = Some(c),
                Err(e) => {
                    view.error = Some(e.to_string());
                    return;
                }
            }
        }
        let Some(client) = self.client.as_mut() else {
            return;
        };
        if view.devices.is_empty() {
            match self.deadline.on("GetInfo", client.info()).await {
                Ok(info) => {
                    view.backend = match proto::Backend::try_from(info.backend) {
                        Ok(proto::Backend::Cuda) => "cuda".into(),
                        Ok(proto::Backend::Host) => "host".into(),
                        _ => "unknown".into(),
                    };
                    view.devices = info.devices;
                }
                Err(e) => {
                    view.error = Some(e.to_string());
                    self.client = None;
                    return;
                }
            }
        }
        let sessions = match self
            .deadline
            .on("ListSessions", client.list_sessions())
            .await
        {
            Ok(s) => s,
            Err(e) => {
                view.error = Some(e.to_string());
                self.client = None;
                return;
            }
        };
        view.error = None;
        let secs = self.at.elapsed().as_secs_f64().max(1e-3);
        self.at = Instant::now();
        let mut next = HashMap::new();
        view.sessions = sessions
            .into_iter()
            .map(|s| {
                let now = s.stats.clone().unwrap_or_default();
                let r = match self.previous.get(&s.session_id) {
                    Some(before) => rates(before, &now, secs),
                    None => Rates::default(),
                };
                next.insert(s.session_id.clone(), now);
                (s, r)
            })
            .collect();
        self.previous = next;
        for d in &view.devices {
            let mbps: f64 = view
                .sessions
                .iter()
                .filter(|(s, _)| s.device_uuid == d.uuid)
                .map(|(_, r)| r.bytes_per_s / 1e6)
                .sum();
            let h = view.history.entry(d.uuid.clone()).or_default();
            h.push_back(mbps.round() as u64);
            while h.len() > self.history {
                h.pop_front();
            }
        }
    }
}

fn pct(x: f64) -> String {
    format!("{:.1} %", 100.0 * x)
}

/// The mean of the fractions given, or "-" when there is none.
fn mean_pct(xs: impl Iterator<Item = f64>) -> String {
    let xs: Vec<f64> = xs.collect();
    if xs.is_empty() {
        "-".into()
    } else {
        pct(xs.iter().sum::<f64>() / xs.len() as f64)
    }
}

/// GB/s with two decimals. A device without sessions sums no rates, and an empty float sum is
/// -0.0, which would print as "-0.00": adding 0.0 makes every zero positive.
fn gbps(bytes_per_s: f64) -> String {
    format!("{:.2}", bytes_per_s / 1e9 + 0.0)
}

/// The title line: the socket, the backend, how many sessions.
fn title(view: &View) -> String {
    let n = view.sessions.len();
    let noun = if n == 1 { "session" } else { "sessions" };
    format!(
        "weightstream top — {} — backend {} — {n} {noun}",
        view.socket, view.backend
    )
}

const DEVICE_COLUMNS: [&str; 8] = [
    "device", "name", "sessions", "GB/s", "GPU wait", "pending", "hit rate", "budget",
];

/// One row per device: its sessions' rates together, and their budgets against its memory.
fn device_rows(view: &View) -> Vec<Vec<String>> {
    view.devices
        .iter()
        .map(|d| {
            let mine: Vec<_> = view
                .sessions
                .iter()
                .filter(|(s, _)| s.device_uuid == d.uuid)
                .collect();
            let bytes: f64 = mine.iter().map(|(_, r)| r.bytes_per_s).sum();
            let budget: u64 = mine.iter().map(|(s, _)| s.vram_budget).sum();
            let use_ = if d.total_memory > 0 {
                pct(budget as f64 / d.total_memory as f64)
            } else {
                "-".into()
            };
            vec![
                shown(&d.uuid),
                shown(&d.name),
                mine.len().to_string(),
                gbps(bytes),
                mean_pct(mine.iter().filter_map(|(_, r)| r.gpu_wait)),
                mean_pct(mine.iter().map(|(_, r)| r.acquire_pending)),
                mean_pct(mine.iter().filter_map(|(_, r)| r.hit_rate)),
                format!("{} / {} ({use_})", human(budget), human(d.total_memory)),
            ]
        })
        .collect()
}

const SESSION_COLUMNS: [&str; 13] = [
    "session",
    "label",
    "pid",
    "GB/s",
    "GPU wait",
    "pending",
    "hit rate",
    "budget",
    "staging",
    "resident",
    "host state",
    "acquires",
    "copied",
];

/// One row per session.
fn session_rows(view: &View) -> Vec<Vec<String>> {
    view.sessions
        .iter()
        .map(|(s, r)| {
            let st = s.stats.clone().unwrap_or_default();
            vec![
                shown(&s.session_id),
                shown(&s.label),
                s.peer_pid.to_string(),
                gbps(r.bytes_per_s),
                r.gpu_wait.map_or_else(|| "-".into(), pct),
                pct(r.acquire_pending),
                r.hit_rate.map_or_else(|| "-".into(), pct),
                human(s.vram_budget),
                human(s.staging_bytes),
                human(s.resident_bytes),
                human(s.state_bytes),
                st.acquires.to_string(),
                human(st.bytes_copied),
            ]
        })
        .collect()
}

const PASS_COLUMNS: [&str; 7] = [
    "session", "kind", "GB/s", "GPU wait", "hit rate", "acquires", "copied",
];

/// One row per session and pass kind it has acquired for.
fn pass_rows(view: &View) -> Vec<Vec<String>> {
    let dash = || "-".to_string();
    (view.sessions.iter())
        .flat_map(|(s, r)| {
            r.kinds.iter().map(|k| {
                vec![
                    shown(&s.session_id),
                    k.kind.to_string(),
                    gbps(k.bytes_per_s),
                    k.gpu_wait.map_or_else(dash, pct),
                    k.hit_rate.map_or_else(dash, pct),
                    k.acquires.to_string(),
                    human(k.bytes_copied),
                ]
            })
        })
        .collect()
}

/// The view as plain text, what `top --once` prints: the title, then the devices, the
/// sessions and their passes by kind as columns.
pub fn plain(view: &View) -> String {
    let table = |columns: &[&str], rows: Vec<Vec<String>>| {
        let mut t = comfy_table::Table::new();
        t.load_style(comfy_table::presets::NOTHING)
            .set_header(columns.to_vec())
            .add_rows(rows);
        let lines: Vec<String> = t.lines().map(|l| l.trim().to_string()).collect();
        lines.join("\n")
    };
    format!(
        "{}\ndevices\n{}\nsessions\n{}\npasses\n{}\n",
        title(view),
        table(&DEVICE_COLUMNS, device_rows(view)),
        table(&SESSION_COLUMNS, session_rows(view)),
        table(&PASS_COLUMNS, pass_rows(view)),
    )
}

/// Draws the whole screen (a pure function of the view, so tests can render it).
pub fn draw(frame: &mut Frame, view: &View) {
    let devices = view.devices.len().max(1) as u16;
    let passes = pass_rows(view);
    let [title_area, devs, spark, sess, kinds, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(devices + 3),
        Constraint::Length(devices * 3),
        Constraint::Min(4),
        Constraint::Length(passes.len().max(1) as u16 + 3),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let bold = Style::default().add_modifier(Modifier::BOLD);
    frame.render_widget(Paragraph::new(Line::styled(title(view), bold)), title_area);

    let rows = device_rows(view).into_iter().map(Row::new);
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(24),
                Constraint::Length(20),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Min(20),
            ],
        )
        .header(Row::new(DEVICE_COLUMNS.to_vec()).style(bold))
        .block(Block::default().borders(Borders::ALL).title(" devices ")),
        devs,
    );

    let lanes = Layout::vertical(vec![Constraint::Length(3); view.devices.len()]).split(spark);
    for (d, area) in view.devices.iter().zip(lanes.iter()) {
        let data: Vec<u64> = view
            .history
            .get(&d.uuid)
            .map(|h| h.iter().copied().collect())
            .unwrap_or_default();
        let peak = data.iter().copied().max().unwrap_or(0);
        frame.render_widget(
            Sparkline::default()
                .data(&data)
                .block(Block::default().borders(Borders::ALL).title(format!(
                    " {} GB/s history (peak {:.2}) ",
                    shown(&d.uuid),
                    peak as f64 / 1e3
                ))),
            *area,
        );
    }

    let rows = session_rows(view).into_iter().map(Row::new);
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(8),
                Constraint::Min(16),
                Constraint::Length(8),
                Constraint::Length(7),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(9),
                Constraint::Length(11),
            ],
        )
        .header(Row::new(SESSION_COLUMNS.to_vec()).style(bold))
        .block(Block::default().borders(Borders::ALL).title(" sessions ")),
        sess,
    );
    let widths = [8, 8, 7, 9, 9, 9, 11].map(Constraint::Length);
    frame.render_widget(
        Table::new(passes.into_iter().map(Row::new), widths)
            .header(Row::new(PASS_COLUMNS.to_vec()).style(bold))
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(" passes by kind "),
            ),
        kinds,
    );

    let status = match &view.error {
        Some(e) => format!("daemon unreachable: {e} (retrying) — q quits"),
        None => "q or Ctrl-C quits; rates are over the last refresh".into(),
    };
    frame.render_widget(Paragraph::new(status), footer);
}

/// Keys arrive on their own thread: crossterm's reads block.
fn spawn_keys() -> mpsc::UnboundedReceiver<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        loop {
            let quit = match event::read() {
                Ok(Event::Key(k)) if k.kind == KeyEventKind::Press => {
                    matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                        || (k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL))
                }
                Ok(_) => false,
                Err(_) => true,
            };
            if quit && tx.send(()).is_err() || tx.is_closed() {
                return;
            }
        }
    });
    rx
}

pub async fn run(socket: Option<PathBuf>, args: TopArgs, deadline: Deadline) -> CliResult {
    let resolved = ResolvedSocket::from_env(socket.as_deref());
    let mut poller = Poller {
        client: None,
        socket: resolved.clone(),
        previous: HashMap::new(),
        at: Instant::now(),
        history: args.history as usize,
        deadline,
    };
    let mut view = View {
        socket: resolved.path.display().to_string(),
        ..View::default()
    };
    let interval = Duration::from_millis(args.interval_ms);
    if args.once {
        // Two samples, one interval apart: the rates are over that interval.
        for sample in [0, 1] {
            if sample == 1 {
                tokio::time::sleep(interval).await;
            }
            poller.refresh(&mut view).await;
            if let Some(error) = view.error.take() {
                return Err(error.into());
            }
        }
        out_part!("{}", plain(&view));
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        return Err(UsageError(NEEDS_TERMINAL.into()).into());
    }
    let mut terminal =
        ratatui::try_init().map_err(|e| UsageError(format!("{NEEDS_TERMINAL} ({e})")))?;
    let mut quit = spawn_keys();
    let mut tick = tokio::time::interval(interval);
    let result = loop {
        tokio::select! {
            _ = quit.recv() => break Ok(()),
            _ = tick.tick() => {
                poller.refresh(&mut view).await;
                if let Err(e) = terminal.draw(|f| draw(f, &view)) {
                    break Err(e);
                }
            }
        }
    };
    ratatui::restore();
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn stats(acquires: u64, hits: u64, bytes: u64, pending_ns: u64) -> proto::SessionStats {
        proto::SessionStats {
            acquires,
            hits,
            bytes_copied: bytes,
            acquire_pending_ns: pending_ns,
            ..Default::default()
        }
    }

    #[test]
    fn rates_are_over_the_interval() {
        let reported = |s: proto::SessionStats, gpu_wait_ns| proto::SessionStats {
            gpu_wait_ns,
            gpu_wait_reports: 1,
            ..s
        };
        let r = rates(
            &reported(stats(10, 5, 1_000, 0), 100_000_000),
            &reported(stats(30, 20, 2_001_000, 250_000_000), 200_000_000),
            2.0,
        );
        assert_eq!(r.bytes_per_s, 1_000_000.0);
        assert_eq!(r.acquire_pending, 0.125);
        assert_eq!(r.gpu_wait, Some(0.05));
        assert_eq!(r.hit_rate, Some(0.75));
        assert_eq!(r.kinds, vec![], "no acquire named a kind");
        let quiet = rates(&stats(3, 3, 0, 0), &stats(3, 3, 0, 0), 1.0);
        assert_eq!(quiet.hit_rate, None);
        assert_eq!(quiet.gpu_wait, None, "a client that never reported");
    }

    #[test]
    fn rates_per_kind_are_over_the_interval_for_the_kinds_acquired() {
        let kind = |kind: proto::PassKind, acquires, hits, bytes, wait_ns| proto::PassStats {
            kind: kind as i32,
            acquires,
            hits,
            bytes_copied: bytes,
            gpu_wait_ns: wait_ns,
            ..Default::default()
        };
        let (train, sample) = (proto::PassKind::Train, proto::PassKind::Sample);
        let before = proto::SessionStats {
            gpu_wait_reports: 1,
            kinds: vec![kind(train, 10, 0, 0, 0), kind(sample, 0, 0, 0, 0)],
            ..Default::default()
        };
        let now = proto::SessionStats {
            gpu_wait_reports: 2,
            kinds: vec![
                kind(train, 10, 0, 500, 0),
                kind(sample, 8, 6, 4_000, 500_000_000),
            ],
            ..Default::default()
        };
        let r = rates(&before, &now, 2.0);
        let want = [
            KindRates {
                kind: "train",
                bytes_per_s: 250.0,
                gpu_wait: Some(0.0),
                hit_rate: None,
                acquires: 10,
                bytes_copied: 500,
            },
            KindRates {
                kind: "sample",
                bytes_per_s: 2_000.0,
                gpu_wait: Some(0.25),
                hit_rate: Some(0.75),
                acquires: 8,
                bytes_copied: 4_000,
            },
        ];
        assert_eq!(r.kinds, want);
    }

    /// A device with one session, as the tests show it.
    fn one_session() -> View {
        View {
            socket: "/run/x.sock".into(),
            backend: "host".into(),
            devices: vec![proto::Device {
                uuid: "host-0".into(),
                name: "host memory".into(),
                total_memory: 8 << 30,
                ..Default::default()
            }],
            sessions: vec![(
                proto::SessionInfo {
                    session_id: "s-7".into(),
                    label: "flux-lora".into(),
                    device_uuid: "host-0".into(),
                    vram_budget: 2 << 30,
                    state_bytes: 3 << 30,
                    ..Default::default()
                },
                Rates {
                    bytes_per_s: 3.5e9,
                    gpu_wait: Some(0.02),
                    acquire_pending: 0.375,
                    hit_rate: Some(0.5),
                    kinds: vec![
                        KindRates {
                            kind: "train",
                            bytes_per_s: 2.5e9,
                            gpu_wait: Some(0.015),
                            hit_rate: Some(0.25),
                            acquires: 40,
                            bytes_copied: 6 << 30,
                        },
                        KindRates {
                            kind: "sample",
                            bytes_per_s: 1e9,
                            gpu_wait: Some(0.005),
                            hit_rate: Some(1.0),
                            acquires: 12,
                            bytes_copied: 1 << 30,
                        },
                    ],
                },
            )],
            ..View::default()
        }
    }

    #[test]
    fn the_screen_shows_devices_and_sessions() {
        let view = one_session();
        let mut t = Terminal::new(TestBackend::new(140, 30)).unwrap();
        t.draw(|f| draw(f, &view)).unwrap();
        let screen: String = t
            .backend()
            .buffer()
            .content()
            .iter()
            .map(|c| c.symbol())
            .collect();
        for want in [
            "s-7",
            "flux-lora",
            "3.50",
            "2.0 %",
            "37.5 %",
            "50.0 %",
            "GPU wait",
            "pending",
            "2.0 GiB / 8.0 GiB (25.0 %)",
            "host state",
            "3.0 GiB",
            "passes by kind",
            "sample",
            "100.0 %",
        ] {
            assert!(screen.contains(want), "{want} not on screen:\n{screen}");
        }
    }

    #[test]
    fn once_prints_the_screen_s_figures_as_plain_lines() {
        assert_eq!(
            plain(&one_session()),
            "weightstream top — /run/x.sock — backend host — 1 session\n\
             devices\n\
             device  name         sessions  GB/s  GPU wait  pending  hit rate  budget\n\
             host-0  host memory  1         3.50  2.0 %     37.5 %   50.0 %    2.0 GiB / 8.0 GiB (25.0 %)\n\
             sessions\n\
             session  label      pid  GB/s  GPU wait  pending  hit rate  budget   staging  resident  host state  acquires  copied\n\
             s-7      flux-lora  0    3.50  2.0 %     37.5 %   50.0 %    2.0 GiB  0 B      0 B       3.0 GiB     0         0 B\n\
             passes\n\
             session  kind    GB/s  GPU wait  hit rate  acquires  copied\n\
             s-7      train   2.50  1.5 %     25.0 %    40        6.0 GiB\n\
             s-7      sample  1.00  0.5 %     100.0 %   12        1.0 GiB\n"
        );
    }

    /// A device without sessions shows 0.00 GB/s (an empty sum of rates is -0.0), and the
    /// title counts "0 sessions", "2 sessions".
    #[test]
    fn an_idle_device_shows_no_negative_zero_and_the_title_counts_sessions() {
        let mut view = one_session();
        view.sessions.clear();
        assert_eq!(
            plain(&view),
            "weightstream top — /run/x.sock — backend host — 0 sessions\n\
             devices\n\
             device  name         sessions  GB/s  GPU wait  pending  hit rate  budget\n\
             host-0  host memory  0         0.00  -         -        -         0 B / 8.0 GiB (0.0 %)\n\
             sessions\n\
             session  label  pid  GB/s  GPU wait  pending  hit rate  budget  staging  resident  host state  acquires  copied\n\
             passes\n\
             session  kind  GB/s  GPU wait  hit rate  acquires  copied\n"
        );
        let twice = one_session().sessions.pop().unwrap();
        view.sessions = vec![twice.clone(), twice];
        assert!(title(&view).ends_with(" — 2 sessions"), "{}", title(&view));
    }
}
