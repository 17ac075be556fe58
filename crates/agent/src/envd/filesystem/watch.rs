//! Directory watching with inotify: one inotify instance per watcher, one watch
//! per directory (the whole subtree when recursive), events named relative to
//! the watched directory.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::unix::AsyncFd;

use super::as_user::{Creds, run_as};
use super::entry::{Names, entry_info};
use super::error::{FsError, FsErrorKind};
use envd_proto::filesystem::{EventType, FilesystemEvent};

/// Events asked of the kernel: everything that maps to an EventType, plus the
/// watched directory's own removal.
fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// The inotify descriptor, shared with the blocking tasks that add watches.
struct Fd(Arc<Inotify>);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

pub struct DirWatcher {
    fd: AsyncFd<Fd>,
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    creds: Creds,
    /// Watch → directory relative to `root` ("" for the root).
    dirs: HashMap<WatchDescriptor, PathBuf>,
    root_gone: bool,
}

impl DirWatcher {
    /// Starts watching `root` (absolute) as the user. A missing path is
    /// NotFound, a non-directory InvalidArgument.
    pub async fn new(
        root: PathBuf,
        recursive: bool,
        include_entry: bool,
        creds: Creds,
    ) -> Result<Self, FsError> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| FsError::new(FsErrorKind::Internal, format!("inotify: {e}")))?;
        let inotify = Arc::new(inotify);
        // SAFETY: the Arc keeps the inotify descriptor open for as long as the
        // AsyncFd lives, and nothing replaces or closes it meanwhile.
        let fd = unsafe { AsyncFd::register(Fd(inotify.clone())) }
            .map_err(|e| FsError::new(FsErrorKind::Internal, format!("inotify: {e}")))?;
        let r = root.clone();
        let md = run_as(&creds, move || {
            std::fs::metadata(&r).map_err(|e| FsError::io("watch", &r, &e))
        })
        .await?;
        if !md.is_dir() {
            return Err(FsError::invalid(format!(
                "{} is not a directory",
                root.display()
            )));
        }
        let mut w = Self {
            fd,
            root,
            recursive,
            include_entry,
            creds,
            dirs: HashMap::new(),
            root_gone: false,
        };
        w.add_tree(PathBuf::new(), true).await?;
        Ok(w)
    }

    /// Watches `rel` (relative to the root) and, when recursive, every
    /// directory below it. Only the root's failure is an error: subdirectories
    /// can vanish or be unreadable. Returns every entry found below `rel`
    /// (relative to the root, parents before children, names in order): for
    /// a directory created after the watch started, whatever was made in it
    /// before its watch was added (`mkdir -p a/b/c`, a file written at once)
    /// has no event of its own.
    async fn add_tree(&mut self, rel: PathBuf, is_root: bool) -> Result<Vec<PathBuf>, FsError> {
        let inotify = self.fd.get_ref().0.clone();
        let root = self.root.clone();
        let recursive = self.recursive;
        let (added, found) = run_as(&self.creds, move || {
            let mut added = Vec::new();
            let mut found = Vec::new();
            // A stack of directories to visit; children pushed in reverse
            // so that they are visited in name order, depth first.
            let mut todo = vec![rel];
            while let Some(rel) = todo.pop() {
                let abs = root.join(&rel);
                match inotify.add_watch(&abs, mask()) {
                    Ok(wd) => added.push((wd, rel.clone())),
                    Err(e) if is_root && added.is_empty() => {
                        return Err(FsError::io("watch", &abs, &e.into()));
                    }
                    Err(e) => {
                        log::debug!("watch {}: {e}", abs.display());
                        continue;
                    }
                }
                if !recursive {
                    break;
                }
                let Ok(read) = std::fs::read_dir(&abs) else {
                    continue;
                };
                let mut entries: Vec<(PathBuf, bool)> = read
                    .flatten()
                    .map(|d| {
                        let is_dir = d.file_type().is_ok_and(|t| t.is_dir());
                        (rel.join(d.file_name()), is_dir)
                    })
                    .collect();
                entries.sort();
                let mut dirs = Vec::new();
                for (path, is_dir) in entries {
                    if is_dir {
                        dirs.push(path.clone());
                    }
                    found.push(path);
                }
                todo.extend(dirs.into_iter().rev());
            }
            Ok::<_, FsError>((added, found))
        })
        .await?;
        self.dirs.extend(added);
        Ok(found)
    }

    /// Waits for the next batch of events. Returns None once the watched
    /// directory itself is gone (removed or moved away).
    pub async fn next(&mut self) -> Result<Option<Vec<FilesystemEvent>>, FsError> {
        loop {
            if self.root_gone {
                return Ok(None);
            }
            let raw = {
                let mut ready =
                    self.fd.readable().await.map_err(|e| {
                        FsError::new(FsErrorKind::Internal, format!("inotify: {e}"))
                    })?;
                match self.fd.get_ref().0.read_events() {
                    Ok(events) => events,
                    Err(nix::errno::Errno::EAGAIN) => {
                        ready.clear_ready();
                        continue;
                    }
                    Err(e) => {
                        return Err(FsError::new(
                            FsErrorKind::Internal,
                            format!("inotify read: {e}"),
                        ));
                    }
                }
            };
            let events = self.translate(raw).await;
            if !events.is_empty() {
                return Ok(Some(events));
            }
        }
    }

    async fn translate(&mut self, raw: Vec<InotifyEvent>) -> Vec<FilesystemEvent> {
        let mut out: Vec<FilesystemEvent> = Vec::new();
        for ev in raw {
            let m = ev.mask;
            if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                log::warn!("watch {}: inotify queue overflowed", self.root.display());
                continue;
            }
            let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
                continue;
            };
            if m.contains(AddWatchFlags::IN_IGNORED) {
                self.dirs.remove(&ev.wd);
                if dir.as_os_str().is_empty() {
                    self.root_gone = true;
                }
                continue;
            }
            if m.intersects(AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF) {
                // Reported by the parent's watch already; the root's own end
                // arrives as IN_IGNORED. A moved-away root stops being ours.
                if dir.as_os_str().is_empty() && m.contains(AddWatchFlags::IN_MOVE_SELF) {
                    self.root_gone = true;
                }
                continue;
            }
            let Some(name) = ev.name else {
                continue;
            };
            let rel = dir.join(&name);
            let event_type = if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
            {
                EventType::Create
            } else if m.contains(AddWatchFlags::IN_MODIFY) {
                EventType::Write
            } else if m.contains(AddWatchFlags::IN_DELETE) {
                EventType::Remove
            } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
                EventType::Rename
            } else if m.contains(AddWatchFlags::IN_ATTRIB) {
                EventType::Chmod
            } else {
                continue;
            };
            // Every IN_MODIFY is a write event, as envd reports them (the
            // kernel itself merges identical events queued unread).
            out.push(FilesystemEvent {
                name: rel.to_string_lossy().into_owned(),
                event_type,
                entry: None,
            });
            if self.recursive
                && event_type == EventType::Create
                && m.contains(AddWatchFlags::IN_ISDIR)
            {
                match self.add_tree(rel.clone(), false).await {
                    // What the new directory already holds is reported as
                    // created after it (envd's watcher does the same).
                    Ok(found) => out.extend(found.into_iter().map(|p| FilesystemEvent {
                        name: p.to_string_lossy().into_owned(),
                        event_type: EventType::Create,
                        entry: None,
                    })),
                    Err(e) => log::debug!("watch {}: {e}", rel.display()),
                }
            }
        }
        if self.include_entry {
            self.attach_entries(&mut out).await;
        }
        out
    }

    /// Stats the entries of events that leave something at the path.
    async fn attach_entries(&self, events: &mut [FilesystemEvent]) {
        let wanted: Vec<(usize, PathBuf)> = events
            .iter()
            .enumerate()
            .filter(|(_, e)| !matches!(e.event_type, EventType::Remove | EventType::Rename))
            .map(|(i, e)| (i, self.root.join(&e.name)))
            .collect();
        if wanted.is_empty() {
            return;
        }
        let found = run_as(&self.creds, move || {
            let mut names = Names::default();
            Ok::<_, std::io::Error>(
                wanted
                    .into_iter()
                    .filter_map(|(i, p)| entry_info(&p, &mut names).ok().map(|e| (i, e)))
                    .collect::<Vec<_>>(),
            )
        })
        .await
        .unwrap_or_default();
        for (i, e) in found {
            events[i].entry = Some(Box::new(e));
        }
    }
}

/// Most events a polled watcher keeps between two GetWatcherEvents calls; the
/// oldest are dropped beyond it.
pub const MAX_QUEUED_EVENTS: usize = 10_000;

/// Watchers polled with GetWatcherEvents, by id.
#[derive(Default, Clone)]
pub struct Watchers {
    inner: Arc<Mutex<HashMap<String, Polled>>>,
}

struct Polled {
    queue: Arc<Mutex<Queue>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Queue {
    events: VecDeque<FilesystemEvent>,
    dropped: u64,
}

impl Watchers {
    /// Starts a background watcher and returns its id.
    pub fn add(&self, mut watcher: DirWatcher) -> String {
        let id = new_id();
        let queue = Arc::new(Mutex::new(Queue::default()));
        let q = queue.clone();
        let root = watcher.root.clone();
        let task = tokio::spawn(async move {
            loop {
                match watcher.next().await {
                    Ok(Some(events)) => {
                        let mut q = q.lock().unwrap_or_else(|p| p.into_inner());
                        for e in events {
                            if q.events.len() >= MAX_QUEUED_EVENTS {
                                q.events.pop_front();
                                q.dropped += 1;
                            }
                            q.events.push_back(e);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        log::warn!("watcher on {}: {e}", root.display());
                        break;
                    }
                }
            }
        });
        self.lock().insert(id.clone(), Polled { queue, task });
        id
    }

    /// Events since the last call; None for an unknown id.
    pub fn take(&self, id: &str) -> Option<Vec<FilesystemEvent>> {
        let map = self.lock();
        let polled = map.get(id)?;
        let mut q = polled.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.dropped > 0 {
            log::warn!("watcher {id}: {} events dropped (queue full)", q.dropped);
            q.dropped = 0;
        }
        Some(q.events.drain(..).collect())
    }

    /// Stops and forgets a watcher; false for an unknown id.
    pub fn remove(&self, id: &str) -> bool {
        match self.lock().remove(id) {
            Some(p) => {
                p.task.abort();
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Polled>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// 128 random bits in hex.
fn new_id() -> String {
    let mut buf = [0u8; 16];
    // SAFETY: getrandom writes at most buf.len() bytes into buf.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        // Entropy not ready this early in boot: uniqueness is all we need.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        return format!("{t:x}{n:x}");
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn collect_until(
        w: &mut DirWatcher,
        want: impl Fn(&[FilesystemEvent]) -> bool,
    ) -> Vec<FilesystemEvent> {
        let mut all = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !want(&all) {
            match tokio::time::timeout_at(deadline, w.next()).await {
                Ok(Ok(Some(evs))) => all.extend(evs),
                Ok(Ok(None)) => break,
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => panic!("timed out; got {all:?}"),
            }
        }
        all
    }

    fn has(evs: &[FilesystemEvent], name: &str, t: EventType) -> bool {
        evs.iter().any(|e| e.name == name && e.event_type == t)
    }

    #[tokio::test]
    async fn create_write_rename_remove_and_chmod() {
        let t = tempfile::tempdir().unwrap();
        let mut w = DirWatcher::new(t.path().into(), false, true, Creds::root())
            .await
            .unwrap();
        let p = t.path().join("a");
        std::fs::write(&p, b"hi").unwrap();
        std::fs::rename(&p, t.path().join("b")).unwrap();
        std::fs::set_permissions(
            t.path().join("b"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        std::fs::remove_file(t.path().join("b")).unwrap();
        let evs = collect_until(&mut w, |e| has(e, "b", EventType::Remove)).await;
        assert!(has(&evs, "a", EventType::Create), "{evs:?}");
        assert!(has(&evs, "a", EventType::Write), "{evs:?}");
        assert!(has(&evs, "a", EventType::Rename), "{evs:?}");
        assert!(has(&evs, "b", EventType::Create), "{evs:?}");
        assert!(has(&evs, "b", EventType::Chmod), "{evs:?}");
        // Removal carries no entry; the rest got one when the file was there.
        assert!(
            evs.iter()
                .filter(|e| e.event_type == EventType::Remove)
                .all(|e| e.entry.is_none())
        );
    }

    #[tokio::test]
    async fn recursive_watch_follows_new_directories() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("old")).unwrap();
        let mut w = DirWatcher::new(t.path().into(), true, false, Creds::root())
            .await
            .unwrap();
        std::fs::write(t.path().join("old/x"), b"").unwrap();
        let evs = collect_until(&mut w, |e| has(e, "old/x", EventType::Create)).await;
        assert!(has(&evs, "old/x", EventType::Create));
        std::fs::create_dir(t.path().join("new")).unwrap();
        let evs = collect_until(&mut w, |e| has(e, "new", EventType::Create)).await;
        assert!(evs.iter().all(|e| e.entry.is_none()));
        // The watch on "new" is in place once its create event has been seen.
        std::fs::write(t.path().join("new/y"), b"1").unwrap();
        collect_until(&mut w, |e| has(e, "new/y", EventType::Create)).await;
    }

    /// A tree made faster than the watcher can add watches (`mkdir -p`, a
    /// file written at once): what the new directory holds when its watch is
    /// added is reported as created, parents first, as envd does.
    #[tokio::test]
    async fn recursive_watch_reports_what_a_new_directory_already_holds() {
        let t = tempfile::tempdir().unwrap();
        let mut w = DirWatcher::new(t.path().into(), true, false, Creds::root())
            .await
            .unwrap();
        std::fs::create_dir_all(t.path().join("a/b/c")).unwrap();
        std::fs::write(t.path().join("a/b/f"), b"x").unwrap();
        std::fs::write(t.path().join("a/e"), b"x").unwrap();
        let evs = collect_until(&mut w, |e| {
            ["a/b/c", "a/b/f", "a/e"]
                .iter()
                .all(|n| has(e, n, EventType::Create))
        })
        .await;
        let created: Vec<&str> = evs
            .iter()
            .filter(|e| e.event_type == EventType::Create)
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(created[0], "a", "{evs:?}");
        let at = |n: &str| created.iter().position(|c| *c == n).unwrap();
        assert!(
            at("a/b") < at("a/b/c") && at("a/b") < at("a/b/f"),
            "{evs:?}"
        );
        // And the new directories are watched from now on.
        std::fs::write(t.path().join("a/b/c/later"), b"1").unwrap();
        collect_until(&mut w, |e| has(e, "a/b/c/later", EventType::Write)).await;
    }

    #[tokio::test]
    async fn non_recursive_ignores_subdirectories_and_ends_with_the_root() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("w");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        let mut w = DirWatcher::new(root.clone(), false, false, Creds::root())
            .await
            .unwrap();
        std::fs::write(root.join("sub/x"), b"").unwrap();
        std::fs::write(root.join("top"), b"").unwrap();
        let evs = collect_until(&mut w, |e| has(e, "top", EventType::Create)).await;
        assert!(!evs.iter().any(|e| e.name.contains("x")), "{evs:?}");
        std::fs::remove_dir_all(&root).unwrap();
        let deadline = Duration::from_secs(5);
        while tokio::time::timeout(deadline, w.next())
            .await
            .unwrap()
            .unwrap()
            .is_some()
        {}
    }

    #[tokio::test]
    async fn missing_and_non_directory_roots() {
        let t = tempfile::tempdir().unwrap();
        let e = DirWatcher::new(t.path().join("nope"), false, false, Creds::root())
            .await
            .err()
            .unwrap();
        assert_eq!(e.kind, FsErrorKind::NotFound);
        std::fs::write(t.path().join("f"), b"").unwrap();
        let e = DirWatcher::new(t.path().join("f"), false, false, Creds::root())
            .await
            .err()
            .unwrap();
        assert_eq!(e.kind, FsErrorKind::InvalidArgument);
    }

    #[tokio::test]
    async fn polled_watchers_queue_and_bound_events() {
        let t = tempfile::tempdir().unwrap();
        let ws = Watchers::default();
        let w = DirWatcher::new(t.path().into(), false, false, Creds::root())
            .await
            .unwrap();
        let id = ws.add(w);
        assert!(ws.take("nope").is_none());
        std::fs::write(t.path().join("f"), b"x").unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut got = Vec::new();
        while !has(&got, "f", EventType::Write) {
            assert!(tokio::time::Instant::now() < deadline, "{got:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
            got.extend(ws.take(&id).unwrap());
        }
        assert!(has(&got, "f", EventType::Create));
        // More events (one create each) than the queue holds: the newest stay.
        for i in 0..(MAX_QUEUED_EVENTS + 100) {
            std::fs::write(t.path().join(format!("g{i}")), b"").unwrap();
        }
        let last = format!("g{}", MAX_QUEUED_EVENTS + 99);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let q = ws.lock().get(&id).unwrap().queue.clone();
            let q = q.lock().unwrap();
            if q.events.back().is_some_and(|e| e.name == last) {
                assert_eq!(q.events.len(), MAX_QUEUED_EVENTS);
                assert!(q.dropped > 0);
                break;
            }
            assert!(tokio::time::Instant::now() < deadline);
        }
        assert!(ws.remove(&id));
        assert!(!ws.remove(&id));
        assert!(ws.take(&id).is_none());
    }
}
