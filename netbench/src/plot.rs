//! Figures like the papers': latency, bandwidth and AM round trip vs message size, GUPS vs ranks.
//! Each figure is written as SVG and PNG. PNG text needs a TrueType font: the first of
//! `NETBENCH_FONT` and the usual system paths that exists is used; without one only SVG is drawn.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::Row;

/// One line of a figure: its legend and (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One figure: file stem, title, axis labels, whether y is logarithmic, and whether x is a
/// message size (then points hold log2 of the size, so the ticks fall on powers of two).
pub struct Figure {
    pub stem: &'static str,
    pub title: &'static str,
    pub x_desc: &'static str,
    pub y_desc: &'static str,
    pub log_y: bool,
    pub x_size: bool,
    pub series: Vec<Series>,
}

/// Rows selected by `keep`, grouped into one series per (api, conduit, op, variant), x and y
/// read by `xy`; groups with fewer than two points are left out (they are not lines).
fn group(
    rows: &[Row],
    keep: impl Fn(&Row) -> bool,
    xy: impl Fn(&Row) -> Option<(f64, f64)>,
) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    // Where the daemons ran over more than one transport, lines say which.
    let mut transports: Vec<&str> = rows.iter().filter_map(|r| r.transport.as_deref()).collect();
    transports.sort_unstable();
    transports.dedup();
    for r in rows.iter().filter(|r| keep(r)) {
        let Some(p) = xy(r) else { continue };
        let mut who = match r.api == r.conduit {
            true => r.api.clone(),
            false => format!("{}/{}", r.api, r.conduit),
        };
        if let (Some(t), true) = (&r.transport, transports.len() > 1) {
            who += &format!(" ({t})");
        }
        if let Some(d) = &r.daemons {
            who += &format!(" (daemons {d})");
        }
        let mut name = match &r.variant {
            Some(v) => format!("{who} {} {v}", r.op),
            None => format!("{who} {}", r.op),
        };
        // Parameters that are not the figure's x make lines of their own.
        if let Some(p) = r.ppn {
            name += &format!(" ppn={p}");
        }
        if let Some(n) = r.nelems {
            name += &format!(" n={n}");
        }
        if r.outstanding.is_some() {
            name += &format!(" {} B", r.size);
        }
        match out.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(p),
            None => out.push(Series {
                name,
                points: vec![p],
            }),
        }
    }
    out.retain(|s| s.points.len() >= 2);
    for s in &mut out {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// The extoll conduit's AM Medium round trip over two raw VELO half round trips, and the udp
/// conduit's over two raw-udp ones, at each size both were measured.
fn overhead(rows: &[Row]) -> Vec<Series> {
    let half = |api: &str, op: &str, size: usize| {
        rows.iter()
            .find(|r| r.bench == "pingpong" && r.api == api && r.op == op && r.size == size)
            .and_then(|r| r.lat_us)
    };
    let mut out = Vec::new();
    for (conduit, raw_api, raw_op) in [("extoll", "extoll", "velo"), ("udp", "raw-udp", "pingpong")]
    {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.bench == "am" && r.conduit == conduit && r.op == "am_medium")
            .filter_map(|r| {
                let raw = half(raw_api, raw_op, r.size)?;
                Some(((r.size.max(1) as f64).log2(), r.lat_us? / (2.0 * raw)))
            })
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        if points.len() >= 2 {
            out.push(Series {
                name: format!("GASNet {conduit} over {raw_api} {raw_op}"),
                points,
            });
        }
    }
    out
}

/// The compare run's figures.
pub fn figures(rows: &[Row]) -> Vec<Figure> {
    let log2 = |r: &Row| (r.size.max(1) as f64).log2();
    let lat = |r: &Row| r.lat_us.map(|l| (log2(r), l));
    let is_put = |op: &str| matches!(op, "put" | "put_blocking" | "pingpong");
    vec![
        Figure {
            stem: "latency_put",
            title: "Put latency (half round trip for ping-pongs)",
            x_desc: "message size (bytes)",
            y_desc: "median latency (µs)",
            x_size: true,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "pingpong" && is_put(&r.op) && r.api != "mpi",
                lat,
            ),
        },
        Figure {
            stem: "latency_get",
            title: "Blocking get latency",
            x_desc: "message size (bytes)",
            y_desc: "median latency (µs)",
            x_size: true,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "pingpong" && r.op == "get" && r.api != "mpi",
                lat,
            ),
        },
        Figure {
            stem: "bandwidth",
            title: "Non-blocking put bandwidth (DMAPP: FMA below 4 KiB, BTE from it)",
            x_desc: "message size (bytes)",
            y_desc: "MB/s",
            x_size: true,
            log_y: false,
            series: group(
                rows,
                |r| r.bench == "bw" && r.api != "mpi",
                |r| r.mb_s.map(|b| (log2(r), b)),
            ),
        },
        Figure {
            stem: "mpi_latency",
            title: "MPI over Portals: send/recv half round trip and one-sided operation latency (seed 003), beside Portals",
            x_desc: "message size (bytes)",
            y_desc: "median latency (µs)",
            x_size: true,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "pingpong" && (r.api == "mpi" || r.api == "portals"),
                lat,
            ),
        },
        Figure {
            stem: "mpi_bandwidth",
            title: "MPI over Portals bandwidth: send/recv (64 in flight) and put, beside Portals put",
            x_desc: "message size (bytes)",
            y_desc: "MB/s",
            x_size: true,
            log_y: false,
            series: group(
                rows,
                |r| r.bench == "bw" && (r.api == "mpi" || r.api == "portals"),
                |r| r.mb_s.map(|b| (log2(r), b)),
            ),
        },
        Figure {
            stem: "mpi_sync",
            title: "MPI synchronisation overhead vs processes: empty epochs at rank 0, collectives (seed 003)",
            x_desc: "ranks",
            y_desc: "median time (µs)",
            x_size: false,
            log_y: true,
            series: group(
                rows,
                |r| r.api == "mpi" && (r.bench == "sync" || r.bench == "coll"),
                |r| Some((r.ranks as f64, r.lat_us?)),
            ),
        },
        Figure {
            stem: "mpi_epoch",
            title: "MPI put latency vs puts per lock epoch (seed 003)",
            x_desc: "puts per epoch",
            y_desc: "median µs per put",
            x_size: false,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "epoch",
                |r| Some((r.per_epoch? as f64, r.lat_us?)),
            ),
        },
        Figure {
            stem: "velo_rma",
            title: "EXTOLL VELO and RMA latency (half round trip), beside gni put and raw UDP",
            x_desc: "message size (bytes)",
            y_desc: "median latency (µs)",
            x_size: true,
            log_y: true,
            series: group(
                rows,
                |r| {
                    r.bench == "pingpong"
                        && ((r.api == "extoll" && matches!(r.op.as_str(), "velo" | "put"))
                            || (r.api == "gni" && r.op == "put")
                            || r.api == "raw-udp")
                },
                lat,
            ),
        },
        Figure {
            stem: "extoll_overhead",
            title: "Conduit overhead over its raw network (AM round trip / 2 half round trips; seed 004 Fig. 11)",
            x_desc: "payload (bytes)",
            y_desc: "× raw",
            x_size: true,
            log_y: false,
            series: overhead(rows),
        },
        Figure {
            stem: "dmapp_nbrate",
            title: "DMAPP non-blocking put rate vs operations outstanding (seed 001 Fig. 4)",
            x_desc: "operations outstanding before each sync",
            y_desc: "Mops",
            x_size: false,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "nbrate",
                |r| Some((r.outstanding? as f64, r.mops?)),
            ),
        },
        Figure {
            stem: "dmapp_strided",
            title: "DMAPP 64-bit strided put rate vs target stride (seed 001 Fig. 5)",
            x_desc: "target stride (elements)",
            y_desc: "million elements/s",
            x_size: false,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "strided",
                |r| Some((r.stride? as f64, r.mops?)),
            ),
        },
        Figure {
            stem: "dmapp_amo",
            title: "DMAPP AMO rate at PE 0 vs job size (seed 001 Fig. 6)",
            x_desc: "ranks",
            y_desc: "Mops (all issuers)",
            x_size: false,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "amo",
                |r| Some((r.ranks as f64, r.mops?)),
            ),
        },
        Figure {
            stem: "am_roundtrip",
            title: "GASNet Active Message round trip",
            x_desc: "payload (bytes)",
            y_desc: "median round trip (µs)",
            x_size: true,
            log_y: true,
            series: group(rows, |r| r.bench == "am" && r.size > 0, lat),
        },
        Figure {
            stem: "gups",
            title: "RandomAccess",
            x_desc: "ranks",
            y_desc: "GUP/s",
            x_size: false,
            log_y: true,
            series: group(
                rows,
                |r| r.bench == "randomaccess",
                |r| r.gups.filter(|g| *g > 0.0).map(|g| (r.ranks as f64, g)),
            ),
        },
    ]
}

/// Writes every figure with at least one line as `<dir>/<stem>.svg` and `.png`; returns the paths.
pub fn write_all(dir: &Path, figs: &[Figure]) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let png = font_loaded();
    let mut paths = Vec::new();
    for f in figs.iter().filter(|f| !f.series.is_empty()) {
        let svg = dir.join(format!("{}.svg", f.stem));
        draw(SVGBackend::new(&svg, (1100, 560)).into_drawing_area(), f)?;
        paths.push(svg);
        if png {
            let p = dir.join(format!("{}.png", f.stem));
            draw(BitMapBackend::new(&p, (1100, 560)).into_drawing_area(), f)?;
            paths.push(p);
        }
    }
    if !png {
        eprintln!(
            "netbench: no TrueType font found (set NETBENCH_FONT=/path/to/font.ttf): SVG only"
        );
    }
    Ok(paths)
}

/// Registers a system font for the bitmap backend once; whether one was found.
fn font_loaded() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        let candidates = std::env::var("NETBENCH_FONT")
            .into_iter()
            .map(PathBuf::from)
            .chain(
                [
                    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                    "/usr/share/fonts/TTF/DejaVuSans.ttf",
                    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                ]
                .map(PathBuf::from),
            );
        for p in candidates {
            if let Ok(bytes) = std::fs::read(&p) {
                // Fonts live for the whole run: plotters keeps a 'static reference.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// The smallest and largest of `vals` ((1, 10) when there are none).
fn bounds(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = vals.fold((f64::MAX, f64::MIN), |(l, h), v| (l.min(v), h.max(v)));
    if lo > hi {
        (1.0, 10.0)
    } else {
        (lo, hi)
    }
}

/// The axis range covering `vals` (with margins), positive for logarithmic axes.
fn range(vals: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = bounds(vals);
    if log {
        (lo.max(1e-9) / 1.5, hi * 1.5)
    } else {
        let pad = ((hi - lo) * 0.06).max(0.5);
        // Non-negative quantities start at zero, as bandwidth figures do.
        (if lo >= 0.0 { 0.0 } else { lo - pad }, hi + pad)
    }
}

/// Tick text for log2 of a size: 8, 1K, 64M at powers of two, nothing between them.
fn size_tick(log2: f64) -> String {
    if (log2 - log2.round()).abs() > 1e-6 || log2 < 0.0 {
        return String::new();
    }
    let v = 1u64 << log2.round() as u32;
    match v {
        v if v >= 1 << 20 => format!("{}M", v >> 20),
        v if v >= 1 << 10 => format!("{}K", v >> 10),
        v => v.to_string(),
    }
}

/// Tick text of a value with the precision its magnitude needs.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 10.0 || a == 0.0 {
        return format!("{v:.0}");
    }
    // Two significant digits, trailing zeros dropped: 2.5, 0.01, 0.00035.
    let decimals = (1.0 - a.log10().floor()).max(1.0) as usize;
    let t = format!("{v:.decimals$}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Tick text for a count (ranks): whole numbers only.
fn count_tick(v: f64) -> String {
    if (v - v.round()).abs() > 1e-6 {
        String::new()
    } else {
        format!("{v:.0}")
    }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, f: &Figure) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e}");
    root.fill(&WHITE).map_err(err)?;
    // The legend gets its own strip on the right so it never hides a line.
    let (plot, legend) = root.split_horizontally(root.dim_in_pixel().0 as i32 - LEGEND_W);
    let pts = || f.series.iter().flat_map(|s| s.points.iter());
    // Half a step beyond the first and last size (or rank count).
    let (x0, x1) = bounds(pts().map(|p| p.0));
    let (x0, x1) = (x0 - 0.5, x1 + 0.5);
    let (y0, y1) = range(pts().map(|p| p.1), f.log_y);
    let xfmt = |x: &f64| {
        if f.x_size {
            size_tick(*x)
        } else {
            count_tick(*x)
        }
    };
    let yfmt = |y: &f64| tick(*y);
    let mut b = ChartBuilder::on(&plot);
    b.caption(f.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64);
    // Linear and logarithmic y are two chart types; one macro body draws both.
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart.map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(f.x_desc)
                .y_desc(f.y_desc)
                .x_labels(12)
                .x_label_formatter(&xfmt)
                .y_label_formatter(&yfmt)
                .light_line_style(RGBColor(238, 238, 238))
                .draw()
                .map_err(err)?;
            for (i, s) in f.series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        color.stroke_width(2),
                    ))
                    .map_err(err)?;
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(err)?;
            }
        }};
    }
    match f.log_y {
        true => body!(b.build_cartesian_2d(x0..x1, (y0..y1).log_scale())),
        false => body!(b.build_cartesian_2d(x0..x1, y0..y1)),
    }
    for (i, s) in f.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let y = 50 + 22 * i as i32;
        legend
            .draw(&PathElement::new(
                vec![(4, y), (28, y)],
                color.stroke_width(3),
            ))
            .map_err(err)?;
        legend
            .draw(&Text::new(s.name.clone(), (34, y - 7), ("sans-serif", 13)))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Width of the legend strip (pixels).
const LEGEND_W: i32 = 250;

#[cfg(test)]
mod tests {
    use super::*;

    fn row(bench: &str, api: &str, conduit: &str, op: &str, size: usize, lat: f64) -> Row {
        let ctx = crate::Ctx {
            hosts: 2,
            iters: 1,
            transport: None,
            daemons: None,
            job: softnic::job::JobInfo {
                rank: 0,
                size: 2,
                job_id: 0,
                job_key: 0,
                daemon: Default::default(),
                rank_hosts: vec![0, 1],
                config: None,
            },
        };
        Row {
            lat_us: Some(lat),
            ..ctx.row(bench, api, conduit, op, size)
        }
    }

    #[test]
    fn series_group_by_api_conduit_and_op_and_drop_single_points() {
        let rows = vec![
            row("pingpong", "gasnet", "udp", "put_blocking", 64, 9.0),
            row("pingpong", "gasnet", "udp", "put_blocking", 8, 8.0),
            row("pingpong", "gni", "gni", "put", 8, 7.0),
            row("pingpong", "gni", "gni", "put", 64, 7.5),
            row("pingpong", "gni", "gni", "get", 8, 9.0),
        ];
        let figs = figures(&rows);
        let put = &figs[0].series;
        assert_eq!(put.len(), 2);
        assert_eq!(put[0].name, "gasnet/udp put_blocking");
        assert_eq!(
            put[0].points,
            vec![(3.0, 8.0), (6.0, 9.0)],
            "log2 sizes, sorted"
        );
        assert_eq!(put[1].name, "gni put");
        assert!(figs[1].series.is_empty(), "one get point is not a line");
    }

    #[test]
    fn lines_name_the_transport_only_when_the_run_used_several() {
        let over = |t: &str, size, lat| Row {
            transport: Some(t.into()),
            ..row("pingpong", "gasnet", "portals", "put_blocking", size, lat)
        };
        let rows = vec![
            over("packet", 8, 6.0),
            over("packet", 64, 6.5),
            over("udp", 8, 8.0),
            over("udp", 64, 8.5),
        ];
        let names: Vec<String> = figures(&rows)[0]
            .series
            .iter()
            .map(|s| s.name.clone())
            .collect();
        assert_eq!(
            names,
            [
                "gasnet/portals (packet) put_blocking",
                "gasnet/portals (udp) put_blocking"
            ]
        );
        let names: Vec<String> = figures(&rows[..2])[0]
            .series
            .iter()
            .map(|s| s.name.clone())
            .collect();
        assert_eq!(names, ["gasnet/portals put_blocking"]);
    }

    #[test]
    fn size_ticks_are_powers_of_two() {
        assert_eq!(size_tick(3.0), "8");
        assert_eq!(size_tick(10.0), "1K");
        assert_eq!(size_tick(20.0), "1M");
        assert_eq!(size_tick(3.5), "");
        assert_eq!(
            (tick(0.01), tick(2.5), tick(0.00035), tick(120.4)),
            ("0.01".into(), "2.5".into(), "0.00035".into(), "120".into())
        );
        assert_eq!((count_tick(2.0), count_tick(2.5)), ("2".into(), "".into()));
    }

    #[test]
    fn writes_svg_with_the_legend() {
        let dir = std::env::temp_dir().join(format!("netbench-plot-{}", std::process::id()));
        let rows: Vec<Row> = (0..4)
            .map(|i| {
                row(
                    "pingpong",
                    "gasnet",
                    "portals",
                    "get",
                    8 << (3 * i),
                    10.0 + i as f64,
                )
            })
            .collect();
        let paths = write_all(&dir, &figures(&rows)).unwrap();
        let svg = std::fs::read_to_string(dir.join("latency_get.svg")).unwrap();
        assert!(
            svg.contains("gasnet/portals get"),
            "legend names the series"
        );
        assert!(paths.iter().all(|p| p.exists()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
