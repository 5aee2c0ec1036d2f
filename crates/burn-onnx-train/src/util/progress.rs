//! Progress bars on stderr: bytes of long transfers (loading and exporting big models) and
//! a run's updates. Drawn by indicatif with the `progress` feature (part of `cli`); a
//! library built without it gets [`Bar`]s that draw nothing, and a run reports through its
//! log lines alone.

/// A progress bar, or nothing where none is shown.
pub struct Bar {
    #[cfg(feature = "progress")]
    inner: indicatif::ProgressBar,
}

#[cfg(feature = "progress")]
impl Bar {
    fn hidden() -> Bar {
        Bar {
            inner: indicatif::ProgressBar::hidden(),
        }
    }

    fn drawn(total: u64, start: u64, template: &str) -> Bar {
        let inner = indicatif::ProgressBar::new(total).with_position(start);
        let style = indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        inner.set_style(style);
        Bar { inner }
    }

    /// Advance by `n`.
    pub fn inc(&self, n: u64) {
        self.inner.inc(n);
    }

    /// Move to `pos`.
    pub fn set_position(&self, pos: u64) {
        self.inner.set_position(pos);
    }

    /// The text beside the bar.
    pub fn set_message(&self, message: String) {
        self.inner.set_message(message);
    }

    /// Run `f` (which prints) with the bar cleared, then redraw it.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.inner.suspend(f)
    }

    /// Remove the bar.
    pub fn finish_and_clear(&self) {
        self.inner.finish_and_clear();
    }
}

#[cfg(not(feature = "progress"))]
impl Bar {
    fn hidden() -> Bar {
        Bar {}
    }

    fn drawn(_total: u64, _start: u64, _template: &str) -> Bar {
        Bar {}
    }

    /// Advance by `n` (nothing to draw without the `progress` feature).
    pub fn inc(&self, _n: u64) {}

    /// Move to `pos` (nothing to draw without the `progress` feature).
    pub fn set_position(&self, _pos: u64) {}

    /// The text beside the bar (nothing to draw without the `progress` feature).
    pub fn set_message(&self, _message: String) {}

    /// Run `f`.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Remove the bar (nothing to remove without the `progress` feature).
    pub fn finish_and_clear(&self) {}
}

fn stderr_is_terminal() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
}

/// A bytes progress bar for transfers of big models (hidden below 256 MB or when stderr is
/// not a terminal).
pub fn progress(total: u64, what: &str) -> Bar {
    if total < 256 << 20 || !stderr_is_terminal() {
        return Bar::hidden();
    }
    Bar::drawn(
        total,
        0,
        &format!("{what} {{bar:30}} {{bytes}}/{{total_bytes}} ({{bytes_per_sec}})"),
    )
}

/// A run's bar of `total` updates from `start`, with its loss and rate as the message;
/// hidden unless `shown`.
pub fn updates(shown: bool, total: usize, start: usize) -> Bar {
    if !shown {
        return Bar::hidden();
    }
    Bar::drawn(
        total as u64,
        start as u64,
        "{bar:30} {pos}/{len} updates | {msg} | ETA {eta}",
    )
}
