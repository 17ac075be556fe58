//! The report's SVG plots, drawn with plotters' SVG backend: samples per
//! column (ours against a reference, one way against another) and values
//! per category as lines (a way's time against k or N).

use plotters::prelude::*;

/// Nearest-rank median (the upper middle of an even count, as the bench's).
pub(super) fn median(samples: &[f64]) -> Option<f64> {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied()
}

/// Samples per category, each a column of points with its median marked.
#[derive(Debug)]
pub(super) struct Strip {
    pub(super) title: String,
    /// Empty: the columns' labels say it all.
    pub(super) x_desc: String,
    pub(super) y_desc: String,
    pub(super) series: Vec<(String, Vec<f64>)>,
}

/// One value per category and series (missing ones are gaps), a line per
/// series.
#[derive(Debug)]
pub(super) struct Lines {
    pub(super) title: String,
    pub(super) x_desc: String,
    pub(super) y_desc: String,
    pub(super) categories: Vec<String>,
    pub(super) series: Vec<(String, Vec<Option<f64>>)>,
}

pub(super) type DrawResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SIZE: (u32, u32) = (720, 420);

fn y_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let top = values.fold(0.0_f64, f64::max);
    // From zero, so that heights compare; a little room above the top.
    0.0..if top > 0.0 { top * 1.1 } else { 1.0 }
}

/// The x range of `n` columns, 0 to n - 1 (an integer range holds its end
/// too); one column alone is the middle of three, as plotters draws a
/// range of one value at its left edge.
fn segments(n: usize) -> Result<std::ops::Range<i32>, std::num::TryFromIntError> {
    Ok(match i32::try_from(n)? {
        1 => -1..1,
        n => 0..n.saturating_sub(1),
    })
}

/// A y tick: whole numbers without a fraction.
fn tick(v: &f64) -> String {
    match v.fract() == 0.0 {
        true => format!("{v:.0}"),
        false => format!("{v}"),
    }
}

pub(super) fn strip_svg(plot: &Strip) -> DrawResult<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let columns = segments(plot.series.len())?;
        let all = plot.series.iter().flat_map(|(_, s)| s.iter().copied());
        let mut chart = ChartBuilder::on(&root)
            .caption(&plot.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(72)
            .build_cartesian_2d(columns.into_segmented(), y_range(all))?;
        let label = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) => usize::try_from(*i)
                .ok()
                .and_then(|i| plot.series.get(i))
                .map_or_else(String::new, |(name, _)| name.clone()),
            _ => String::new(),
        };
        let mut mesh = chart.configure_mesh();
        mesh.disable_x_mesh()
            .light_line_style(WHITE)
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 14))
            .y_label_formatter(&tick)
            .x_labels(plot.series.len() + 1)
            .x_label_formatter(&label)
            .y_desc(&plot.y_desc);
        if !plot.x_desc.is_empty() {
            mesh.x_desc(&plot.x_desc);
        }
        mesh.draw()?;
        for (i, (_, samples)) in plot.series.iter().enumerate() {
            let at = SegmentValue::CenterOf(i32::try_from(i)?);
            let color = Palette99::pick(i).mix(0.7).filled();
            // Spread sideways a little so that equal samples stay countable.
            chart.draw_series(samples.iter().zip((-2..=2).cycle()).map(|(&v, dx)| {
                EmptyElement::at((at.clone(), v)) + Circle::new((dx * 5, 0), 4, color)
            }))?;
            if let Some(m) = median(samples) {
                chart.draw_series(std::iter::once(
                    EmptyElement::at((at.clone(), m))
                        + Rectangle::new([(-24, -1), (24, 1)], BLACK.filled()),
                ))?;
            }
        }
        root.present()?;
    }
    Ok(svg)
}

pub(super) fn lines_svg(plot: &Lines) -> DrawResult<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let count = i32::try_from(plot.categories.len())?;
        let columns = segments(plot.categories.len())?;
        let all = plot
            .series
            .iter()
            .flat_map(|(_, s)| s.iter().flatten().copied());
        let mut chart = ChartBuilder::on(&root)
            .caption(&plot.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(72)
            .build_cartesian_2d(columns.into_segmented(), y_range(all))?;
        let label = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) => usize::try_from(*i)
                .ok()
                .and_then(|i| plot.categories.get(i))
                .cloned()
                .unwrap_or_default(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 14))
            .y_label_formatter(&tick)
            .x_labels(plot.categories.len() + 1)
            .x_label_formatter(&label)
            .x_desc(&plot.x_desc)
            .y_desc(&plot.y_desc)
            .draw()?;
        for (i, (name, values)) in plot.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(SegmentValue<i32>, f64)> = values
                .iter()
                .zip(0..count)
                .filter_map(|(v, x)| v.map(|v| (SegmentValue::CenterOf(x), v)))
                .collect();
            chart.draw_series(
                points
                    .iter()
                    .map(|p| Circle::new(p.clone(), 4, color.filled())),
            )?;
            // A line only between neighbouring categories that both have a
            // value: a gap is a failed or unmeasured case.
            let segments = values
                .windows(2)
                .zip(0..count)
                .filter_map(|(w, x)| match w {
                    [Some(a), Some(b)] => Some(PathElement::new(
                        vec![
                            (SegmentValue::CenterOf(x), *a),
                            (SegmentValue::CenterOf(x + 1), *b),
                        ],
                        color.stroke_width(2),
                    )),
                    _ => None,
                });
            chart
                .draw_series(segments)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}
