//! `weightstream top`: a live view of the daemon's devices and sessions, refreshed from
//! `ListSessions`. Rates (GB/s, stall %, hit rate) are over the last refresh interval, so they
//! show what is happening now rather than since the session opened.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table};
use tokio::sync::mpsc;
use weightstream_client::{Client, proto};

use super::{CliResult, human, shown};

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// Refresh interval in milliseconds.
    #[arg(long, env = "WEIGHTSTREAM_TOP_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(100..=60_000))]
    interval_ms: u64,
    /// Samples of history kept per device (the sparkline's width).
    #[arg(long, env = "WEIGHTSTREAM_TOP_HISTORY", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(2..=10_000))]
    history: u64,
}

/// Rates of one session over the last interval.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rates {
    pub bytes_per_s: f64,
    /// Fraction of the interval the client spent waiting for Staged.
    pub stall: f64,
    /// Hits over acquires in the interval; None when it made no acquire.
    pub hit_rate: Option<f64>,
}

/// Counter deltas over `secs` as rates.
pub fn rates(before: &proto::SessionStats, now: &proto::SessionStats, secs: f64) -> Rates {
    let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
    let acquires = d(before.acquires, now.acquires);
    Rates {
        bytes_per_s: d(before.bytes_copied, now.bytes_copied) / secs,
        stall: (d(before.stall_ns, now.stall_ns) / 1e9 / secs).min(1.0),
        hit_rate: (acquires > 0.0).then(|| d(before.hits, now.hits) / acquires),
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
    socket: Option<PathBuf>,
    previous: HashMap<String, proto::SessionStats>,
    at: Instant,
    history: usize,
}

impl Poller {
    async fn refresh(&mut self, view: &mut View) {
        if self.client.is_none() {
            match Client::connect(self.socket.as_deref()).await {
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
            match client.info().await {
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
        let sessions = match client.list_sessions().await {
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
                let now = s.stats.unwrap_or_default();
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

fn gbps(bytes_per_s: f64) -> String {
    format!("{:.2}", bytes_per_s / 1e9)
}

/// Draws the whole screen (a pure function of the view, so tests can render it).
pub fn draw(frame: &mut Frame, view: &View) {
    let devices = view.devices.len().max(1) as u16;
    let [title, devs, spark, sess, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(devices + 3),
        Constraint::Length(devices * 3),
        Constraint::Min(4),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let bold = Style::default().add_modifier(Modifier::BOLD);
    frame.render_widget(
        Paragraph::new(Line::styled(
            format!(
                "weightstream top — {} — backend {} — {} sessions",
                view.socket,
                view.backend,
                view.sessions.len()
            ),
            bold,
        )),
        title,
    );

    let rows = view.devices.iter().map(|d| {
        let mine: Vec<_> = view
            .sessions
            .iter()
            .filter(|(s, _)| s.device_uuid == d.uuid)
            .collect();
        let bytes: f64 = mine.iter().map(|(_, r)| r.bytes_per_s).sum();
        let stall = if mine.is_empty() {
            0.0
        } else {
            mine.iter().map(|(_, r)| r.stall).sum::<f64>() / mine.len() as f64
        };
        let hit: Vec<f64> = mine.iter().filter_map(|(_, r)| r.hit_rate).collect();
        let hit = if hit.is_empty() {
            "-".to_string()
        } else {
            pct(hit.iter().sum::<f64>() / hit.len() as f64)
        };
        let budget: u64 = mine.iter().map(|(s, _)| s.vram_budget).sum();
        let use_ = if d.total_memory > 0 {
            pct(budget as f64 / d.total_memory as f64)
        } else {
            "-".into()
        };
        Row::new(vec![
            shown(&d.uuid),
            shown(&d.name),
            mine.len().to_string(),
            gbps(bytes),
            pct(stall),
            hit,
            format!("{} / {} ({use_})", human(budget), human(d.total_memory)),
        ])
    });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(24),
                Constraint::Length(20),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(9),
                Constraint::Min(20),
            ],
        )
        .header(
            Row::new(vec![
                "device", "name", "sessions", "GB/s", "stall", "hit rate", "budget",
            ])
            .style(bold),
        )
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

    let rows = view.sessions.iter().map(|(s, r)| {
        let st = s.stats.unwrap_or_default();
        Row::new(vec![
            shown(&s.session_id),
            shown(&s.label),
            s.peer_pid.to_string(),
            gbps(r.bytes_per_s),
            pct(r.stall),
            r.hit_rate.map_or_else(|| "-".into(), pct),
            human(s.vram_budget),
            human(s.staging_bytes),
            human(s.resident_bytes),
            st.acquires.to_string(),
            human(st.bytes_copied),
        ])
    });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(8),
                Constraint::Min(16),
                Constraint::Length(8),
                Constraint::Length(7),
                Constraint::Length(8),
                Constraint::Length(9),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(9),
                Constraint::Length(11),
            ],
        )
        .header(
            Row::new(vec![
                "session", "label", "pid", "GB/s", "stall", "hit rate", "budget", "staging",
                "resident", "acquires", "copied",
            ])
            .style(bold),
        )
        .block(Block::default().borders(Borders::ALL).title(" sessions ")),
        sess,
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

pub async fn run(socket: Option<PathBuf>, args: TopArgs) -> CliResult {
    let shown = Client::socket_path(socket.as_deref());
    let mut poller = Poller {
        client: None,
        socket,
        previous: HashMap::new(),
        at: Instant::now(),
        history: args.history as usize,
    };
    let mut view = View {
        socket: shown.display().to_string(),
        ..View::default()
    };
    let mut terminal = ratatui::init();
    let mut quit = spawn_keys();
    let mut tick = tokio::time::interval(Duration::from_millis(args.interval_ms));
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

    fn stats(acquires: u64, hits: u64, bytes: u64, stall_ns: u64) -> proto::SessionStats {
        proto::SessionStats {
            acquires,
            hits,
            bytes_copied: bytes,
            stall_ns,
            ..Default::default()
        }
    }

    #[test]
    fn rates_are_over_the_interval() {
        let r = rates(
            &stats(10, 5, 1_000, 0),
            &stats(30, 20, 2_001_000, 250_000_000),
            2.0,
        );
        assert_eq!(r.bytes_per_s, 1_000_000.0);
        assert_eq!(r.stall, 0.125);
        assert_eq!(r.hit_rate, Some(0.75));
        assert_eq!(
            rates(&stats(3, 3, 0, 0), &stats(3, 3, 0, 0), 1.0).hit_rate,
            None
        );
    }

    #[test]
    fn the_screen_shows_devices_and_sessions() {
        let view = View {
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
                    ..Default::default()
                },
                Rates {
                    bytes_per_s: 3.5e9,
                    stall: 0.02,
                    hit_rate: Some(0.5),
                },
            )],
            ..View::default()
        };
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
            "50.0 %",
            "2.0 GiB / 8.0 GiB (25.0 %)",
        ] {
            assert!(screen.contains(want), "{want} not on screen:\n{screen}");
        }
    }
}
