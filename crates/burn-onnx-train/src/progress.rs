//! Progress of long byte transfers (loading and exporting big models) on stderr.

use indicatif::{ProgressBar, ProgressStyle};

/// A bytes progress bar on stderr for transfers of big models (hidden below 256 MB or when
/// stderr is not a terminal).
pub fn progress(total: u64, what: &str) -> ProgressBar {
    if total < 256 << 20 || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(&format!(
        "{what} {{bar:30}} {{bytes}}/{{total_bytes}} ({{bytes_per_sec}})"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}
