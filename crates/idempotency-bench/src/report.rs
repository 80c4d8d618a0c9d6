//! The report: a Markdown table, JSON, and PNG charts under `target/bench/`.

use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::{
    fault::Bucket,
    stats::{Measured, Round},
};

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Settings of the run.
    pub settings: serde_json::Value,
    /// Every scenario.
    pub measured: Vec<Measured>,
    /// Framework / baseline ratios.
    pub ratios: Vec<Ratio>,
    /// The fault timeline.
    pub timeline: Vec<Bucket>,
}

/// One ratio: the framework over its baseline, or one variant over another.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// What is divided by what.
    pub what: String,
    /// The ratio; in the side-by-side groups, the median of the rounds' ratios.
    pub value: f64,
    /// In the side-by-side groups, the lowest and the highest round's ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub range: Option<(f64, f64)>,
}

impl Ratio {
    /// A ratio measured once.
    pub fn new(what: impl Into<String>, value: f64) -> Self {
        Self {
            what: what.into(),
            value,
            range: None,
        }
    }

    /// The median of per-round ratios, with their range. `None` when there are none, or when
    /// a round's ratio is not a positive number (a side completed nothing in that round):
    /// such a ratio is refused rather than reported over the other rounds.
    fn over_rounds(what: String, mut per_round: Vec<f64>) -> Option<Self> {
        if per_round.iter().any(|r| !r.is_finite() || *r <= 0.0) {
            return None;
        }
        per_round.sort_by(f64::total_cmp);
        let n = per_round.len();
        let median = match n {
            0 => return None,
            _ if n % 2 == 1 => per_round[n / 2],
            _ => (per_round[n / 2 - 1] + per_round[n / 2]) / 2.0,
        };
        Some(Self {
            what,
            value: median,
            range: Some((per_round[0], per_round[n - 1])),
        })
    }
}

fn find<'a>(m: &'a [Measured], group: &str, name: &str) -> Option<&'a Measured> {
    m.iter().find(|x| x.group == group && x.name == name)
}

/// Throughput ratios of each framework scenario to its baseline.
pub(crate) fn ratios(m: &[Measured]) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut ratio = |label: String, group: &str, a: &str, b: &str| {
        if let (Some(x), Some(y)) = (find(m, group, a), find(m, group, b))
            && y.ops_per_sec > 0.0
        {
            out.push(Ratio::new(label, x.ops_per_sec / y.ops_per_sec));
        }
    };
    for group in ["store-seq", "store-conc"] {
        for store in [
            "memory",
            "postgres",
            "postgres (per-request)",
            "redis",
            "hybrid",
            "hybrid (no mirror)",
        ] {
            ratio(
                format!("{group} {store} / baseline"),
                group,
                store,
                &format!("baseline {store}"),
            );
        }
    }
    ratio(
        "http first: layer hybrid (no mirror) / hand-written hybrid".into(),
        "http-first",
        "layer hybrid (no mirror)",
        "hand-written hybrid",
    );
    ratio(
        "http first: layer hybrid / hand-written hybrid".into(),
        "http-first",
        "layer hybrid",
        "hand-written hybrid",
    );
    ratio(
        "http first: layer hybrid / no idempotency".into(),
        "http-first",
        "layer hybrid",
        "no idempotency",
    );
    ratio(
        "http first: layer postgres / layer postgres (per-request)".into(),
        "http-first",
        "layer postgres",
        "layer postgres (per-request)",
    );
    ratio(
        "http first: layer hybrid / layer postgres".into(),
        "http-first",
        "layer hybrid",
        "layer postgres",
    );
    ratio(
        "http first: layer hybrid (adaptive) / layer postgres".into(),
        "http-first",
        "layer hybrid (adaptive)",
        "layer postgres",
    );
    ratio(
        "http first: layer redis / hand-written redis".into(),
        "http-first",
        "layer redis",
        "hand-written redis",
    );
    ratio(
        "http replay: layer hybrid / hand-written single GET".into(),
        "http-replay",
        "layer hybrid",
        "hand-written single GET",
    );
    ratio(
        "http replay: layer hybrid (adaptive) / hand-written single GET".into(),
        "http-replay",
        "layer hybrid (adaptive)",
        "hand-written single GET",
    );
    ratio(
        "http replay: layer postgres / hand-written single GET".into(),
        "http-replay",
        "layer postgres",
        "hand-written single GET",
    );
    // The side-by-side groups (A B … B A, in rounds): each round's ratio, their median.
    let per_round = |group: &str, a: &str, b: &str, figure: fn(&Round) -> f64| {
        let (x, y) = (find(m, group, a)?, find(m, group, b)?);
        let rounds = x.rounds.iter().zip(&y.rounds);
        Some(
            rounds
                .map(|(x, y)| figure(x) / figure(y))
                .collect::<Vec<_>>(),
        )
    };
    let throughput = |r: &Round| r.ops_per_sec;
    for (what, group, a, b) in [
        ("first", "http-first-abba", "layer hybrid", "layer postgres"),
        (
            "first",
            "http-first-abba",
            "layer hybrid (adaptive)",
            "layer postgres",
        ),
        (
            "first",
            "http-first-abba",
            "layer redis",
            "hand-written redis",
        ),
        (
            "first",
            "http-first-abba",
            "hand-written redis (fenced)",
            "hand-written redis",
        ),
        (
            "first",
            "http-first-abba",
            "layer redis",
            "hand-written redis (fenced)",
        ),
        (
            "first",
            "http-first-gc",
            "layer postgres",
            "layer postgres (per-request)",
        ),
        (
            "first",
            "http-first-gc",
            "layer postgres (2 in flight)",
            "layer postgres",
        ),
        (
            "replay",
            "http-replay-abba",
            "layer hybrid",
            "hand-written single GET",
        ),
        (
            "replay",
            "http-replay-abba",
            "hand-written replay (checked)",
            "hand-written single GET",
        ),
        (
            "replay",
            "http-replay-abba",
            "layer hybrid",
            "hand-written replay (checked)",
        ),
    ] {
        let label = format!("http {what}, side by side: {a} / {b}");
        out.extend(per_round(group, a, b, throughput).and_then(|r| Ratio::over_rounds(label, r)));
    }
    // An empty round's p99 is 0: its ratio is refused (see `Ratio::over_rounds`).
    let p99 = |r: &Round| r.p99_us as f64;
    let c1 = per_round(
        "http-first-c1",
        "layer postgres",
        "layer postgres (per-request)",
        p99,
    );
    out.extend(c1.and_then(|r| {
        let label = "http first, 1 connection, p99 latency: layer postgres / per-request";
        Ratio::over_rounds(label.into(), r)
    }));
    out
}

impl Report {
    /// The Markdown tables.
    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "| group | scenario | ops | errors | ops/s | p50 µs | p99 µs | p99.9 µs |\n|---|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for m in &self.measured {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.0} | {} | {} | {} |\n",
                m.group, m.name, m.ops, m.errors, m.ops_per_sec, m.p50_us, m.p99_us, m.p999_us
            ));
        }
        s.push_str("\n| ratio | value | rounds' range |\n|---|---:|---:|\n");
        for r in &self.ratios {
            let range = r
                .range
                .map(|(low, high)| format!("{low:.2}–{high:.2}"))
                .unwrap_or_default();
            s.push_str(&format!("| {} | {:.2} | {range} |\n", r.what, r.value));
        }
        if let (Some(calls), Some(statements)) = (
            self.settings["group_commit_calls"].as_u64(),
            self.settings["group_commit_statements"].as_u64(),
        ) {
            s.push_str(&format!(
                "\nGroup commit (the batched Postgres store, every scenario above): {calls} calls in \
                 {statements} statements, {:.1} calls per statement.\n",
                calls as f64 / statements.max(1) as f64
            ));
        }
        if !self.timeline.is_empty() {
            let paused: Vec<_> = self.timeline.iter().filter(|b| b.redis_paused).collect();
            let worst = paused.iter().map(|b| b.p99_us).max().unwrap_or(0);
            let settled = paused.iter().skip(3).map(|b| b.p99_us).max().unwrap_or(0);
            let errors: u64 = self.timeline.iter().map(|b| b.errors).sum();
            s.push_str(&format!(
                "\nFault timeline (hybrid, Redis paused for {} ms): worst 100 ms p99 while paused {worst} µs; \
                 after the first 300 ms of the pause {settled} µs; errors {errors}.\n",
                paused.len() * 100
            ));
        }
        s
    }

    /// Writes `results.json`, `throughput.png` and `fault_timeline.png` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(self)?)?;
        let text = font();
        self.throughput_chart(&dir.join("throughput.png"), text)?;
        self.timeline_chart(&dir.join("fault_timeline.png"), text)?;
        Ok(())
    }

    fn throughput_chart(&self, path: &Path, text: bool) -> Result<(), Box<dyn std::error::Error>> {
        let bars: Vec<&Measured> = self
            .measured
            .iter()
            .filter(|m| m.group != "store-seq")
            .collect();
        let root =
            BitMapBackend::new(path, (1100, 40 + 26 * bars.len() as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let max = bars.iter().map(|m| m.ops_per_sec).fold(1.0, f64::max);
        let (label_w, bar_w) = (360.0, 1100.0 - 360.0 - 110.0);
        for (i, m) in bars.iter().enumerate() {
            let y = 30 + 26 * i as i32;
            // Log scale: memory runs at ~10^6/s, network stores at ~10^3/s.
            let w = ((m.ops_per_sec.max(1.0)).log10() / max.log10().max(1.0) * bar_w) as i32;
            let color = if m.name.starts_with("baseline")
                || m.name.starts_with("hand-written")
                || m.name == "no idempotency"
            {
                RGBColor(150, 150, 150)
            } else {
                RGBColor(40, 110, 200)
            };
            root.draw(&Rectangle::new(
                [(label_w as i32, y), (label_w as i32 + w.max(1), y + 20)],
                color.filled(),
            ))?;
            if text {
                let style = ("sans-serif", 15).into_font().color(&BLACK);
                root.draw(&Text::new(
                    format!("{} · {}", m.group, m.name),
                    (8, y + 3),
                    style.clone(),
                ))?;
                root.draw(&Text::new(
                    format!("{:.0}/s", m.ops_per_sec),
                    (label_w as i32 + w + 6, y + 3),
                    style,
                ))?;
            }
        }
        if text {
            root.draw(&Text::new(
                "Throughput (ops/s, log scale); grey = baselines",
                (8, 6),
                ("sans-serif", 17).into_font().color(&BLACK),
            ))?;
        }
        root.present()?;
        Ok(())
    }

    fn timeline_chart(&self, path: &Path, text: bool) -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (1000, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let end = self.timeline.last().map_or(1, |b| b.at_ms + 100);
        let top = self
            .timeline
            .iter()
            .map(|b| b.p99_us)
            .max()
            .unwrap_or(1)
            .max(1) as f64
            / 1000.0
            * 1.1;
        let mut builder = ChartBuilder::on(&root);
        builder.margin(15);
        if text {
            builder
                .caption(
                    "Hybrid under load, Redis paused (shaded): p99 per 100 ms",
                    ("sans-serif", 18),
                )
                .x_label_area_size(35)
                .y_label_area_size(55);
        }
        let mut chart = builder.build_cartesian_2d(0u64..end, 0f64..top)?;
        if text {
            chart
                .configure_mesh()
                .x_desc("ms")
                .y_desc("p99 ms")
                .draw()?;
        }
        for b in self.timeline.iter().filter(|b| b.redis_paused) {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(b.at_ms, 0.0), (b.at_ms + 100, top)],
                RGBColor(255, 220, 200).filled(),
            )))?;
        }
        chart.draw_series(LineSeries::new(
            self.timeline
                .iter()
                .map(|b| (b.at_ms + 50, b.p99_us as f64 / 1000.0)),
            &BLUE,
        ))?;
        root.present()?;
        Ok(())
    }
}

/// Registers a system font for chart text; charts are drawn without text if none is found.
fn font() -> bool {
    for path in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ] {
        if let Ok(bytes) = std::fs::read(path) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::Ratio;

    fn over(rounds: &[f64]) -> Option<(f64, (f64, f64))> {
        Ratio::over_rounds("r".into(), rounds.to_vec())
            .map(|r| (r.value, r.range.unwrap_or_default()))
    }

    #[test]
    fn the_median_of_an_odd_count_is_the_middle_round() {
        assert_eq!(over(&[0.9, 0.7, 0.8, 1.2, 0.85]), Some((0.85, (0.7, 1.2))));
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(over(&[1.0, 0.5, 2.0, 0.75]), Some((0.875, (0.5, 2.0))));
    }

    #[test]
    fn a_round_in_which_a_side_completed_nothing_refuses_the_ratio() {
        assert_eq!(over(&[0.9, f64::INFINITY, 0.8]), None);
        assert_eq!(over(&[0.9, f64::NAN, 0.8]), None);
        assert_eq!(over(&[0.9, 0.0, 0.8]), None);
        assert_eq!(over(&[]), None);
    }
}
