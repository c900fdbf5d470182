//! What the kit found: per request and fault, the property that broke, the shortest
//! history that shows it, and what to change.

use std::fmt;

/// A property of exactly-once that a history broke.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Broke {
    /// The request did not succeed when sent once, with nothing going wrong: the kit
    /// has nothing to compare the faults with (or could not run it at all).
    Setup {
        /// What happened instead.
        what: String,
    },
    /// A counted effect ([`Effect`](super::Effect)) was made more often than when the
    /// request ran once.
    EffectTwice {
        /// The effect's name.
        effect: String,
        /// Its change when the request ran once.
        once: i64,
        /// Its change in this history.
        found: i64,
    },
    /// A counted effect was made less often than when the request ran once, though the
    /// request answered.
    EffectLost {
        /// The effect's name.
        effect: String,
        /// Its change when the request ran once.
        once: i64,
        /// Its change in this history.
        found: i64,
    },
    /// An outside service was called again where idem could have replayed its call.
    OutsideCalledAgain {
        /// The stand-in's name.
        service: String,
        /// Its calls when the request ran once.
        once: usize,
        /// Its calls in this history.
        found: usize,
    },
    /// An outside service made more effects than when the request ran once.
    OutsideEffectTwice {
        /// The stand-in's name.
        service: String,
        /// Its effects when the request ran once.
        once: u64,
        /// Its effects in this history.
        found: u64,
    },
    /// An outside service made fewer effects than when the request ran once, though the
    /// request answered.
    OutsideEffectLost {
        /// The stand-in's name.
        service: String,
        /// Its effects when the request ran once.
        once: u64,
        /// Its effects in this history.
        found: u64,
    },
    /// A final answer of the key differed from its first one.
    AnswerChanged {
        /// The first final answer: its status and body.
        first: String,
        /// The later one.
        then: String,
    },
    /// After the faults, the client's retry did not get the answer the request gives
    /// when nothing goes wrong.
    NotCompleted {
        /// The retry's answer: its status and body.
        answer: String,
    },
    /// An outside call happened and nothing records it: no answer committed, no step
    /// recorded for an operator to see.
    Invisible {
        /// The stand-in that was called.
        service: String,
    },
    /// With the database unreachable, the request was not answered 503, or made an
    /// effect.
    RanWithoutDatabase {
        /// What it did.
        what: String,
    },
}

impl Broke {
    /// Whether `other` is the same property broken on the same effect or service
    /// (whatever the figures): the report keeps the shortest history of each.
    pub(super) fn same_as(&self, other: &Broke) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && self.subject() == other.subject()
    }

    fn subject(&self) -> Option<&str> {
        match self {
            Broke::EffectTwice { effect, .. } | Broke::EffectLost { effect, .. } => Some(effect),
            Broke::OutsideCalledAgain { service, .. }
            | Broke::OutsideEffectTwice { service, .. }
            | Broke::OutsideEffectLost { service, .. }
            | Broke::Invisible { service } => Some(service),
            _ => None,
        }
    }
}

impl fmt::Display for Broke {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Broke::Setup { what } => write!(f, "the kit could not run the request: {what}"),
            Broke::EffectTwice {
                effect,
                once,
                found,
            } => write!(
                f,
                "`{effect}` changed by {found} where one run changes it by {once}"
            ),
            Broke::EffectLost {
                effect,
                once,
                found,
            } => write!(
                f,
                "`{effect}` changed by {found} where one run changes it by {once}"
            ),
            Broke::OutsideCalledAgain {
                service,
                once,
                found,
            } => write!(
                f,
                "`{service}` was called {found} times where one run calls it {once} times"
            ),
            Broke::OutsideEffectTwice {
                service,
                once,
                found,
            }
            | Broke::OutsideEffectLost {
                service,
                once,
                found,
            } => write!(
                f,
                "`{service}` made {found} effects where one run makes {once}"
            ),
            Broke::AnswerChanged { first, then } => {
                write!(f, "the key answered {then} after it had answered {first}")
            }
            Broke::NotCompleted { answer } => {
                write!(f, "the client's last retry answered {answer}")
            }
            Broke::Invisible { service } => {
                write!(f, "`{service}` was called and nothing records the request")
            }
            Broke::RanWithoutDatabase { what } => {
                write!(f, "with the database unreachable, {what}")
            }
        }
    }
}

/// One broken property: which request, what history shows it, and what to change.
#[derive(Debug, Clone)]
pub struct Finding {
    pub(super) request: String,
    pub(super) broke: Broke,
    pub(super) history: Vec<String>,
    pub(super) advice: String,
}

impl Finding {
    /// The request, as `POST /charges`.
    pub fn request(&self) -> &str {
        &self.request
    }

    /// The property that broke.
    pub fn broke(&self) -> &Broke {
        &self.broke
    }

    /// The shortest history found that breaks it, one sentence per move.
    pub fn history(&self) -> &[String] {
        &self.history
    }

    /// What to change in the handler, in a sentence.
    pub fn advice(&self) -> &str {
        &self.advice
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}: {}", self.request, self.broke)?;
        for (n, step) in self.history.iter().enumerate() {
            writeln!(f, "  {}. {step}", n + 1)?;
        }
        write!(f, "  -> {}", self.advice)
    }
}

/// What a run of the kit found. It prints as a list of findings with their histories,
/// and the seed that repeats the run.
#[derive(Debug, Clone)]
pub struct Report {
    pub(super) seed: u64,
    pub(super) histories: usize,
    pub(super) findings: Vec<Finding>,
}

impl Report {
    /// The seed the run drew its keys, interleavings and histories from: set
    /// `IDEM_KIT_SEED` to it (or [`Kit::seed`](super::Kit::seed)) to run the same again.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// How many histories ran, over every request.
    pub fn histories(&self) -> usize {
        self.histories
    }

    /// Each property broken, once per request, with its shortest history.
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// Whether every history kept every property.
    pub fn is_exactly_once(&self) -> bool {
        self.findings.is_empty()
    }

    /// Panics with the report unless every history kept every property.
    ///
    /// # Panics
    ///
    /// If [`Report::findings`] is not empty.
    #[track_caller]
    pub fn assert_exactly_once(&self) {
        assert!(self.is_exactly_once(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.findings.is_empty() {
            return write!(
                f,
                "idem's test kit: {} histories kept exactly-once (IDEM_KIT_SEED={})",
                self.histories, self.seed
            );
        }
        writeln!(
            f,
            "idem's test kit: {} of the properties broke over {} histories (IDEM_KIT_SEED={} repeats the run):",
            self.findings.len(),
            self.histories,
            self.seed
        )?;
        for finding in &self.findings {
            writeln!(f)?;
            writeln!(f, "{finding}")?;
        }
        Ok(())
    }
}
