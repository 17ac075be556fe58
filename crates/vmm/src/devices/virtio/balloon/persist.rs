//! What a snapshot saves of the balloon, and the device it restores: its
//! configuration, the driver's sizes and the statistics buffer the guest
//! left with it (without it the guest's statistics would stop after a
//! restore: the guest waits for that buffer to come back).

use serde::{Deserialize, Serialize};

use super::device::{Balloon, BalloonConfig, BalloonError};

/// The balloon in a snapshot. The field order is the snapshot file's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBalloon {
    pub deflate_on_oom: bool,
    pub stats_polling_interval_s: u16,
    pub free_page_reporting: bool,
    /// `num_pages` and `actual`, in 4 KiB pages.
    pub target_pages: u32,
    pub actual_pages: u32,
    pub stats_desc: Option<u16>,
}

impl Balloon {
    /// What a snapshot records of this balloon; pause it first.
    pub fn save(&self) -> SavedBalloon {
        let config = self.config();
        let s = self.shared().lock().unwrap_or_else(|e| e.into_inner());
        SavedBalloon {
            deflate_on_oom: config.deflate_on_oom,
            stats_polling_interval_s: s.stats_interval_s,
            free_page_reporting: config.free_page_reporting,
            target_pages: s.target_pages,
            actual_pages: s.actual_pages,
            stats_desc: self.held_stats_desc(),
        }
    }
}

impl SavedBalloon {
    pub fn restore(&self) -> Result<Balloon, BalloonError> {
        let mut balloon = Balloon::new(BalloonConfig {
            amount_mib: 0,
            deflate_on_oom: self.deflate_on_oom,
            stats_polling_interval_s: self.stats_polling_interval_s,
            free_page_reporting: self.free_page_reporting,
        })?;
        balloon.restore_state(self.target_pages, self.actual_pages, self.stats_desc);
        Ok(balloon)
    }
}
