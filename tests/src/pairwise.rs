//! An all-pairs (pairwise) cover of a few axes of settings: a small set of cells such that
//! every pair of values of any two axes appears in at least one cell, except the pairs a
//! constraint refuses, each with the reason why. Deterministic: the same axes and
//! constraints give the same cells in the same order, so a failing cell keeps its number.
//!
//! The cover is greedy, one cell at a time (as AETG does): among the cells that start from
//! each pair still uncovered, and fill the other axes one by one with the value that
//! covers most uncovered pairs among those already chosen, it keeps the cell that covers
//! most; ties go to the earlier pair, and to the value in fewest cells so far (then the
//! earlier value), so that the axes a cell leaves free rotate through their values instead
//! of repeating the first. Constraints are on pairs of values; a value is only chosen when
//! the cell can still be completed (backtracking), so no cell holds a refused pair, and an
//! allowed pair that no valid cell can hold (two constraints that together refuse it)
//! stops the generator with that pair named.

use std::collections::BTreeSet;
use std::fmt;

/// One axis of settings: its name and the names of its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Axis {
    /// The axis, as printed (`mode`).
    pub name: &'static str,
    /// Its values, as printed (`default`, `pooler`, `portable`).
    pub values: &'static [&'static str],
}

/// An axis of a cover: an enum whose variants are its values, with their printed names,
/// `ALL` (the values in order), `AXIS` (the [`Axis`] for [`cover`]) and `name()`.
#[macro_export]
macro_rules! axis {
    ($(#[$doc:meta])* $name:ident as $label:literal {
        $($(#[$value_doc:meta])* $value:ident = $text:literal,)*
    }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum $name {
            $($(#[$value_doc])* $value,)*
        }

        impl $name {
            /// The values, in the axis's order.
            const ALL: &[Self] = &[$(Self::$value,)*];
            /// The axis, for the generator.
            const AXIS: $crate::pairwise::Axis = $crate::pairwise::Axis {
                name: $label,
                values: &[$($text,)*],
            };

            /// The printed name.
            fn name(self) -> &'static str {
                Self::AXIS.values[self as usize]
            }
        }
    };
}

/// A value of an axis: (axis index, value index).
pub type Choice = (usize, usize);

/// A pair of values of two axes, the lower axis first.
pub type Pair = (Choice, Choice);

/// A pair no cell may hold, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The pair.
    pub pair: Pair,
    /// Why it cannot be configured (a compile error, a start-up refusal, a setting that
    /// does not exist there).
    pub reason: &'static str,
}

/// The cells of a cover, each a value index per axis, and the pairs refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cover {
    /// The axes the cover is over.
    pub axes: Vec<Axis>,
    /// One value index per axis for each cell.
    pub cells: Vec<Vec<usize>>,
    /// The pairs no cell holds, with their reasons, in axis and value order.
    pub refused: Vec<Refusal>,
}

/// Every pair of values of two different axes, the lower axis first, in order.
pub fn pairs(axes: &[Axis]) -> Vec<Pair> {
    let mut all = Vec::new();
    for a in 0..axes.len() {
        for b in a + 1..axes.len() {
            for va in 0..axes[a].values.len() {
                for vb in 0..axes[b].values.len() {
                    all.push(((a, va), (b, vb)));
                }
            }
        }
    }
    all
}

/// The pairs a cell holds.
pub fn pairs_of(cell: &[usize]) -> impl Iterator<Item = Pair> + '_ {
    (0..cell.len())
        .flat_map(move |a| (a + 1..cell.len()).map(move |b| ((a, cell[a]), (b, cell[b]))))
}

/// A pairwise cover of `axes`; `refuse` says why a pair of values cannot be combined
/// (called with the lower axis first), or `None` when it can.
///
/// Panics when an allowed pair fits in no valid cell: the constraints then refuse it
/// together, and should say so for that pair.
pub fn cover(axes: &[Axis], refuse: impl Fn(Choice, Choice) -> Option<&'static str>) -> Cover {
    assert!(
        axes.iter().all(|axis| !axis.values.is_empty()),
        "every axis needs a value"
    );
    let mut refused = Vec::new();
    let mut uncovered = BTreeSet::new();
    for pair in pairs(axes) {
        match refuse(pair.0, pair.1) {
            Some(reason) => refused.push(Refusal { pair, reason }),
            None => {
                uncovered.insert(pair);
            }
        }
    }
    let allowed = |a: Choice, b: Choice| {
        let (low, high) = if a.0 < b.0 { (a, b) } else { (b, a) };
        refuse(low, high).is_none()
    };
    let mut cells: Vec<Vec<usize>> = Vec::new();
    while !uncovered.is_empty() {
        let mut usage: Vec<Vec<usize>> = axes.iter().map(|a| vec![0; a.values.len()]).collect();
        for cell in &cells {
            for (axis, &value) in cell.iter().enumerate() {
                usage[axis][value] += 1;
            }
        }
        let mut best: Option<(usize, Vec<usize>)> = None;
        for &(p, q) in &uncovered {
            let Some(cell) = fill(axes, &allowed, &uncovered, &usage, (p, q)) else {
                panic!(
                    "{} and {} are allowed together, but no cell can hold both: their \
                     constraints refuse the pair together; refuse it with its reason",
                    show(axes, p),
                    show(axes, q)
                );
            };
            let gain = pairs_of(&cell)
                .filter(|pair| uncovered.contains(pair))
                .count();
            if best.as_ref().is_none_or(|(most, _)| gain > *most) {
                best = Some((gain, cell));
            }
        }
        let (_, cell) = best.expect("an uncovered pair");
        for pair in pairs_of(&cell) {
            uncovered.remove(&pair);
        }
        cells.push(cell);
    }
    Cover {
        axes: axes.to_vec(),
        cells,
        refused,
    }
}

/// A valid cell holding both values of `pair`, the other axes filled greedily; `None`
/// when there is none. `usage` counts how many cells so far hold each value.
fn fill(
    axes: &[Axis],
    allowed: &impl Fn(Choice, Choice) -> bool,
    uncovered: &BTreeSet<Pair>,
    usage: &[Vec<usize>],
    (p, q): Pair,
) -> Option<Vec<usize>> {
    if !allowed(p, q) {
        return None;
    }
    let mut cell: Vec<Option<usize>> = vec![None; axes.len()];
    cell[p.0] = Some(p.1);
    cell[q.0] = Some(q.1);
    let context = Context {
        axes,
        allowed,
        uncovered,
        usage,
    };
    if context.complete(&mut cell, 0) {
        Some(cell.into_iter().map(|v| v.expect("filled")).collect())
    } else {
        None
    }
}

/// What filling a cell reads.
struct Context<'a, F> {
    axes: &'a [Axis],
    allowed: &'a F,
    uncovered: &'a BTreeSet<Pair>,
    usage: &'a [Vec<usize>],
}

impl<F: Fn(Choice, Choice) -> bool> Context<'_, F> {
    /// Fills the open axes from `axis` on, each with the allowed value that covers most
    /// uncovered pairs with the values chosen so far (on a tie, the value in fewest
    /// cells, then the earlier one), backtracking when a choice leaves a later axis
    /// without an allowed value.
    fn complete(&self, cell: &mut [Option<usize>], axis: usize) -> bool {
        if axis == self.axes.len() {
            return true;
        }
        if cell[axis].is_some() {
            return self.complete(cell, axis + 1);
        }
        let chosen: Vec<Choice> = cell
            .iter()
            .enumerate()
            .filter_map(|(a, v)| v.map(|v| (a, v)))
            .collect();
        let mut candidates: Vec<(usize, usize, usize)> = (0..self.axes[axis].values.len())
            .filter(|&value| chosen.iter().all(|&c| (self.allowed)(c, (axis, value))))
            .map(|value| {
                let gain = chosen
                    .iter()
                    .filter(|&&c| {
                        let pair = if c.0 < axis {
                            (c, (axis, value))
                        } else {
                            ((axis, value), c)
                        };
                        self.uncovered.contains(&pair)
                    })
                    .count();
                (gain, self.usage[axis][value], value)
            })
            .collect();
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for (_, _, value) in candidates {
            cell[axis] = Some(value);
            if self.complete(cell, axis + 1) {
                return true;
            }
        }
        cell[axis] = None;
        false
    }
}

/// `axis=value`.
fn show(axes: &[Axis], (axis, value): Choice) -> String {
    format!("{}={}", axes[axis].name, axes[axis].values[value])
}

impl Cover {
    /// A cell as `mode=default key=digest ...`.
    pub fn describe(&self, cell: &[usize]) -> String {
        cell.iter()
            .enumerate()
            .map(|(axis, &value)| show(&self.axes, (axis, value)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl fmt::Display for Cover {
    /// How many cells, each of them, and each refused pair with its reason.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sizes: Vec<String> = self
            .axes
            .iter()
            .map(|a| format!("{} {}", a.name, a.values.len()))
            .collect();
        let allowed = pairs(&self.axes).len() - self.refused.len();
        writeln!(
            f,
            "{} cells over {} axes ({}) cover all {allowed} allowed pairs of values; {} pairs \
             refused by design",
            self.cells.len(),
            self.axes.len(),
            sizes.join(", "),
            self.refused.len()
        )?;
        for (n, cell) in self.cells.iter().enumerate() {
            writeln!(f, "  cell {n:2}: {}", self.describe(cell))?;
        }
        for refusal in &self.refused {
            let (a, b) = refusal.pair;
            writeln!(
                f,
                "  refused: {} with {}: {}",
                show(&self.axes, a),
                show(&self.axes, b),
                refusal.reason
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ABC: &[&str] = &["a", "b", "c"];

    fn axes(n: usize) -> Vec<Axis> {
        const NAMES: [&str; 5] = ["p", "q", "r", "s", "t"];
        NAMES[..n]
            .iter()
            .map(|&name| Axis { name, values: ABC })
            .collect()
    }

    /// Every pair not refused is in a cell; no cell holds a refused pair.
    fn check(cover: &Cover, refuse: impl Fn(Choice, Choice) -> Option<&'static str>) {
        let held: BTreeSet<Pair> = cover.cells.iter().flat_map(|c| pairs_of(c)).collect();
        for pair in pairs(&cover.axes) {
            match refuse(pair.0, pair.1) {
                None => assert!(held.contains(&pair), "{pair:?} is not covered"),
                Some(_) => assert!(!held.contains(&pair), "{pair:?} is refused but held"),
            }
        }
        for cell in &cover.cells {
            assert_eq!(cell.len(), cover.axes.len());
            for (axis, &value) in cell.iter().enumerate() {
                assert!(value < cover.axes[axis].values.len());
            }
        }
    }

    #[test]
    fn every_pair_is_covered_in_few_cells() {
        // Four axes of three values: 9 cells is the optimum (an orthogonal array);
        // a greedy cover stays close to it, far below the 81 of every combination.
        let axes = axes(4);
        let cover = cover(&axes, |_, _| None);
        check(&cover, |_, _| None);
        assert!(cover.cells.len() <= 12, "{cover}");
        assert!(cover.refused.is_empty());
    }

    #[test]
    fn refused_pairs_are_held_by_no_cell_and_listed_with_their_reason() {
        let refuse = |a: Choice, b: Choice| match (a, b) {
            ((0, 0), (1, 1)) => Some("p=a never goes with q=b"),
            ((1, 2), (3, _)) => Some("q=c has no s"),
            _ => None,
        };
        // `q=c` fits with no `s`: refused with `s`, so it cannot be in a cell at all;
        // its pairs with `p` and `r` must then be refused too, or the generator stops.
        let with_q_c_alone = |a: Choice, b: Choice| {
            refuse(a, b).or(match (a, b) {
                ((0, _), (1, 2)) | ((1, 2), (2, _)) => Some("q=c has no s"),
                _ => None,
            })
        };
        let axes = axes(4);
        let cover = cover(&axes, with_q_c_alone);
        check(&cover, with_q_c_alone);
        assert_eq!(cover.refused.len(), 1 + 3 + 3 + 3);
        assert_eq!(
            cover.refused[0],
            Refusal {
                pair: ((0, 0), (1, 1)),
                reason: "p=a never goes with q=b"
            }
        );
        let text = cover.to_string();
        assert!(
            text.contains("refused: p=a with q=b: p=a never goes with q=b"),
            "{text}"
        );
        assert!(text.contains("cell  0: p="), "{text}");
    }

    #[test]
    fn a_choice_that_leaves_a_later_axis_empty_is_taken_back() {
        // Each value of s is refused by one of p=a, q=a, r=a. A cell started from
        // (p=a, q=a) first tries r=a (every r gains as much, a comes first), which leaves
        // s no value: it must take r=a back and try r=b.
        let refuse = |a: Choice, b: Choice| match (a, b) {
            ((0, 0), (3, 0)) => Some("p=a refuses s=a"),
            ((1, 0), (3, 1)) => Some("q=a refuses s=b"),
            ((2, 0), (3, 2)) => Some("r=a refuses s=c"),
            _ => None,
        };
        let axes = axes(4);
        let cover = cover(&axes, refuse);
        check(&cover, refuse);
    }

    #[test]
    #[should_panic(expected = "p=a and q=a are allowed together, but no cell can hold both")]
    fn a_pair_refused_only_by_two_constraints_together_stops_the_generator() {
        let refuse = |a: Choice, b: Choice| match (a, b) {
            ((0, 0), (2, 0 | 1)) => Some("p=a needs r=c"),
            ((1, 0), (2, 2)) => Some("q=a refuses r=c"),
            _ => None,
        };
        cover(&axes(3), refuse);
    }

    #[test]
    fn the_same_axes_give_the_same_cells() {
        let axes = [
            Axis {
                name: "mode",
                values: &["default", "pooler", "portable"],
            },
            Axis {
                name: "key",
                values: &["header", "id", "field", "digest", "once"],
            },
            Axis {
                name: "isolation",
                values: &["rc", "rr", "s"],
            },
        ];
        let refuse = |a: Choice, b: Choice| match (a, b) {
            ((1, 4), (2, 1 | 2)) => Some("once runs at read committed"),
            _ => None,
        };
        let first = cover(&axes, refuse);
        assert_eq!(first, cover(&axes, refuse));
        check(&first, refuse);
        // The two largest axes alone need 5 × 3 cells, less the 2 refused.
        assert!(first.cells.len() >= 13, "{first}");
    }
}
