//! OCI and docker-archive templates from image fixtures written here with
//! the `tar` crate: layers applied in order with whiteouts and opaque
//! directories, owners and modes kept, the image config returned, digests
//! checked, and the ext4 image inspected with debugfs (e2fsprogs).

#![cfg(test)]

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::{agent, debugfs, gzip, sha};
use template_build::{BuildError, Builder, ImageConfig, OciImage, Source, apply_layers};

enum Kind<'a> {
    Dir,
    File(&'a [u8]),
    Symlink(&'a str),
    Hardlink(&'a str),
}

struct E<'a>(&'a str, Kind<'a>, u32, u64);

/// A layer tar: (path, kind, mode, uid=gid).
fn layer(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for E(path, kind, mode, id) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(*mode);
        h.set_uid(*id);
        h.set_gid(*id);
        h.set_mtime(1_700_000_000);
        match kind {
            Kind::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
            Kind::File(data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).unwrap();
            }
            Kind::Symlink(target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                b.append_link(&mut h, path, target).unwrap();
            }
            Kind::Hardlink(target) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_size(0);
                b.append_link(&mut h, path, target).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

const CONFIG: &str = r#"{"architecture":"amd64","os":"linux","config":{
  "Env":["PATH=/usr/local/bin:/usr/bin:/bin","GREETING=a=b c"],
  "WorkingDir":"/home/app","User":"1000:1000",
  "Entrypoint":["/usr/bin/hello"],"Cmd":["--serve","8080"]},
  "rootfs":{"type":"layers","diff_ids":[]}}"#;

/// Three layers:
/// 1. a base: dirs, an executable, a user-owned home, files to delete later,
///    a symlink, a hard link, an absolute symlink, a setuid file
/// 2. (gzip) whiteouts: a file, a directory; an opaque directory with a new
///    file; a file replaced; a directory replaced by a file
/// 3. a file under a directory created only implicitly
fn layers() -> Vec<Vec<u8>> {
    let l1 = layer(&[
        E("usr/", Kind::Dir, 0o755, 0),
        E("usr/bin/", Kind::Dir, 0o755, 0),
        E(
            "usr/bin/hello",
            Kind::File(b"#!/bin/sh\necho hello\n"),
            0o755,
            0,
        ),
        E(
            "usr/bin/hello-again",
            Kind::Hardlink("usr/bin/hello"),
            0o755,
            0,
        ),
        E("usr/bin/hi", Kind::Symlink("hello"), 0o777, 0),
        E("usr/bin/su", Kind::File(b"suid"), 0o4755, 0),
        E("bin", Kind::Symlink("/usr/bin"), 0o777, 0),
        E("etc/", Kind::Dir, 0o755, 0),
        E("etc/config", Kind::File(b"v1\n"), 0o644, 0),
        E(
            "etc/escape",
            Kind::Symlink("../../../../etc/passwd"),
            0o777,
            0,
        ),
        E("home/", Kind::Dir, 0o755, 0),
        E("home/app/", Kind::Dir, 0o750, 1000),
        E("home/app/data.txt", Kind::File(b"data"), 0o600, 1000),
        E("opt/", Kind::Dir, 0o755, 0),
        E("opt/old.txt", Kind::File(b"old"), 0o644, 0),
        E("opt/gone/", Kind::Dir, 0o755, 0),
        E("opt/gone/inner.txt", Kind::File(b"x"), 0o644, 0),
        E("opt/opaque/", Kind::Dir, 0o755, 0),
        E("opt/opaque/lower.txt", Kind::File(b"lower"), 0o644, 0),
        E("opt/opaque/sub/", Kind::Dir, 0o755, 0),
        E("opt/opaque/sub/lower2.txt", Kind::File(b"lower"), 0o644, 0),
        E("opt/becomes-file/", Kind::Dir, 0o755, 0),
        E("opt/becomes-file/x", Kind::File(b"x"), 0o644, 0),
    ]);
    let l2 = gzip(&layer(&[
        E("opt/.wh.old.txt", Kind::File(b""), 0o644, 0),
        E("opt/.wh.gone", Kind::File(b""), 0o644, 0),
        E(
            "opt/opaque/kept-same-layer.txt",
            Kind::File(b"same"),
            0o644,
            0,
        ),
        E("opt/opaque/.wh..wh..opq", Kind::File(b""), 0o644, 0),
        E("opt/opaque/upper.txt", Kind::File(b"upper"), 0o644, 0),
        E("etc/config", Kind::File(b"v2\n"), 0o640, 0),
        E("opt/becomes-file", Kind::File(b"now a file"), 0o644, 0),
    ]));
    let l3 = layer(&[E("var/lib/app/state", Kind::File(b"s"), 0o644, 1000)]);
    vec![l1, l2, l3]
}

/// Writes an OCI image layout of `layers()` to `dir`.
fn write_layout(dir: &Path) {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| -> String {
        let h = sha(data);
        fs::write(blobs.join(&h), data).unwrap();
        format!("sha256:{h}")
    };
    let config = put(CONFIG.as_bytes());
    let mut layer_descs = Vec::new();
    for (n, l) in layers().iter().enumerate() {
        let media = if n == 1 { "tar+gzip" } else { "tar" };
        layer_descs.push(format!(
            r#"{{"mediaType":"application/vnd.oci.image.layer.v1.{media}","digest":"{}","size":{}}}"#,
            put(l),
            l.len()
        ));
    }
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config}","size":{}}},"layers":[{}]}}"#,
        CONFIG.len(),
        layer_descs.join(",")
    );
    let m = put(manifest.as_bytes());
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{m}","size":{}}}]}}"#,
            manifest.len()
        ),
    )
    .unwrap();
}

/// Writes a classic `docker save` tarball of `layers()` to `path`.
fn write_docker_archive(path: &Path) {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, name, data).unwrap();
    };
    add("cfg.json", CONFIG.as_bytes());
    let mut names = Vec::new();
    for (n, l) in layers().iter().enumerate() {
        let name = format!("l{n}/layer.tar");
        add(&name, l);
        names.push(format!("\"{name}\""));
    }
    add(
        "manifest.json",
        format!(
            r#"[{{"Config":"cfg.json","RepoTags":["fixture:1"],"Layers":[{}]}}]"#,
            names.join(",")
        )
        .as_bytes(),
    );
    fs::write(path, b.into_inner().unwrap()).unwrap();
}

fn expected_config() -> ImageConfig {
    ImageConfig {
        env: vec![
            ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()),
            ("GREETING".into(), "a=b c".into()),
        ],
        working_dir: Some("/home/app".into()),
        user: Some("1000:1000".into()),
        entrypoint: vec!["/usr/bin/hello".into()],
        cmd: vec!["--serve".into(), "8080".into()],
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A scratch directory with the layout written into it, as root (template
/// builds keep file owners).
fn root_and_layout() -> (tempfile::TempDir, std::path::PathBuf) {
    assert!(
        is_root(),
        "template builds keep file owners: run the tests as root"
    );
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    write_layout(&layout);
    (tmp, layout)
}

#[test]
fn layers_apply_in_order_with_whiteouts_owners_and_modes() {
    let (tmp, layout) = root_and_layout();
    let image = OciImage::open_layout(&layout).unwrap();
    assert_eq!(image.config, expected_config());
    assert_eq!(image.layers.len(), 3);
    let root = tmp.path().join("root");
    fs::create_dir(&root).unwrap();
    let mut lines = Vec::new();
    apply_layers(&root, &image.layers, &mut |l| lines.push(l.to_owned())).unwrap();
    assert_eq!(lines.len(), 3, "one log line per layer: {lines:?}");

    let meta = |p: &str| fs::symlink_metadata(root.join(p)).unwrap();
    let read = |p: &str| fs::read_to_string(root.join(p)).unwrap();
    let gone = |p: &str| fs::symlink_metadata(root.join(p)).is_err();
    // modes and owners
    assert_eq!(meta("usr/bin/hello").mode() & 0o7777, 0o755);
    assert_eq!(meta("usr/bin/su").mode() & 0o7777, 0o4755);
    assert_eq!(meta("home/app").mode() & 0o7777, 0o750);
    assert_eq!(
        (meta("home/app").uid(), meta("home/app").gid()),
        (1000, 1000)
    );
    assert_eq!(meta("home/app/data.txt").uid(), 1000);
    assert_eq!(meta("home/app/data.txt").mode() & 0o777, 0o600);
    assert_eq!(meta("usr/bin/hello").mtime(), 1_700_000_000);
    // links
    assert_eq!(
        meta("usr/bin/hello-again").ino(),
        meta("usr/bin/hello").ino()
    );
    assert_eq!(
        fs::read_link(root.join("usr/bin/hi")).unwrap(),
        Path::new("hello")
    );
    // absolute and escaping links are made relative, inside the root
    assert_eq!(
        fs::read_link(root.join("bin")).unwrap(),
        Path::new("usr/bin")
    );
    assert_eq!(
        fs::read_link(root.join("etc/escape")).unwrap(),
        Path::new("passwd")
    );
    assert_eq!(read("bin/hello"), "#!/bin/sh\necho hello\n");
    // later layers replace and delete
    assert_eq!(read("etc/config"), "v2\n");
    assert_eq!(meta("etc/config").mode() & 0o777, 0o640);
    assert!(gone("opt/old.txt") && gone("opt/gone") && gone("opt/.wh.old.txt"));
    assert!(
        gone("opt/opaque/lower.txt") && gone("opt/opaque/sub"),
        "opaque dir hides the layers below"
    );
    assert_eq!(read("opt/opaque/upper.txt"), "upper");
    assert_eq!(read("opt/opaque/kept-same-layer.txt"), "same");
    assert!(gone("opt/opaque/.wh..wh..opq"));
    assert!(meta("opt/becomes-file").is_file());
    assert_eq!(read("opt/becomes-file"), "now a file");
    // parents made for an entry that has none
    assert!(meta("var/lib").is_dir());
    assert_eq!(meta("var/lib/app/state").uid(), 1000);
}

#[test]
fn corrupt_or_unsafe_images_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    write_layout(&layout);
    let image = OciImage::open_layout(&layout).unwrap();
    // a layer whose bytes no longer match its digest
    let victim = &image.layers[2].path;
    let mut data = fs::read(victim).unwrap();
    data[600] ^= 0xff;
    fs::write(victim, &data).unwrap();
    let root = tmp.path().join("root");
    fs::create_dir(&root).unwrap();
    let err = apply_layers(&root, &image.layers, &mut |_| {}).unwrap_err();
    assert!(matches!(err, BuildError::UnreadableImage { .. }), "{err}");
    assert!(err.to_string().contains("digest"), "{err}");

    // an entry climbing out of the root
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(4);
    h.set_mode(0o644);
    h.as_gnu_mut().unwrap().name[..12].copy_from_slice(b"../../escape");
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"evil"[..]).unwrap();
    let evil = tmp.path().join("evil.tar");
    fs::write(&evil, b.into_inner().unwrap()).unwrap();
    let layer = template_build::Layer {
        path: evil,
        sha256: None,
    };
    let err = apply_layers(&root, &[layer], &mut |_| {}).unwrap_err();
    assert!(matches!(err, BuildError::UnsafePath(_)), "{err}");
    assert!(!tmp.path().join("escape").exists());

    // not an image at all
    let err = OciImage::open_layout(tmp.path()).err().unwrap();
    assert!(matches!(err, BuildError::UnreadableImage { .. }), "{err}");
}

fn check_image(image: &Path) {
    let stat = debugfs(image, "stat /home/app/data.txt");
    assert!(
        stat.contains("User:  1000") && stat.contains("Group:  1000"),
        "{stat}"
    );
    assert!(stat.contains("Mode:  0600"), "{stat}");
    let su = debugfs(image, "stat /usr/bin/su");
    assert!(su.contains("Mode:  04755"), "{su}");
    assert_eq!(debugfs(image, "cat /etc/config"), "v2\n");
    assert_eq!(debugfs(image, "cat /opt/opaque/upper.txt"), "upper");
    let opt = debugfs(image, "ls /opt");
    assert!(!opt.contains("old.txt") && !opt.contains("gone"), "{opt}");
    let opaque = debugfs(image, "ls /opt/opaque");
    assert!(
        !opaque.contains("lower") && opaque.contains("upper.txt"),
        "{opaque}"
    );
    // the agent is init, and the sandbox's host files are in place
    assert_eq!(
        debugfs(image, "cat /usr/local/sbin/sandfork-agent"),
        "#!/bin/sh\nexit 0\n"
    );
    let init = debugfs(image, "stat /sbin/init");
    assert!(
        init.contains("Type: symlink") && init.contains("/usr/local/sbin/sandfork-agent"),
        "{init}"
    );
    assert_eq!(debugfs(image, "cat /etc/hostname"), "sandbox\n");
}

#[test]
fn oci_layout_and_docker_archive_build_cached_ext4_images() {
    let (tmp, layout) = root_and_layout();
    let builder = Builder::new(agent(tmp.path()))
        .cache_dir(tmp.path().join("cache"))
        .image_size(64 << 20);
    let mut lines = Vec::new();
    let t = builder
        .build(&Source::OciLayout(layout.clone()), &mut |l| {
            lines.push(l.to_owned())
        })
        .unwrap();
    assert!(!t.cached);
    assert_eq!(t.config, expected_config());
    assert!(t.rootfs.starts_with(builder.templates_dir().join(&t.key)));
    assert!(lines.iter().any(|l| l.contains("layer 2/3")), "{lines:?}");
    check_image(&t.rootfs);

    let again = builder
        .build(&Source::OciLayout(layout), &mut |_| {})
        .unwrap();
    assert!(again.cached);
    assert_eq!(
        (again.key, again.rootfs, again.config),
        (t.key.clone(), t.rootfs, t.config)
    );

    let archive = tmp.path().join("image.tar");
    write_docker_archive(&archive);
    let d = builder
        .build(&Source::DockerArchive(archive), &mut |_| {})
        .unwrap();
    assert_ne!(d.key, t.key);
    assert_eq!(d.config, expected_config());
    check_image(&d.rootfs);
    // nothing left behind but the entries, their locks and the scripts
    for e in fs::read_dir(builder.templates_dir()).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(!name.starts_with(".tmp-"), "{name}");
    }
}

#[test]
fn unreadable_sources_give_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let builder = Builder::new(agent(tmp.path())).cache_dir(tmp.path().join("cache"));
    let err = builder
        .build(
            &Source::DockerArchive(tmp.path().join("missing.tar")),
            &mut |_| {},
        )
        .unwrap_err();
    assert!(matches!(err, BuildError::UnreadableImage { .. }), "{err}");
    let junk = tmp.path().join("junk.tar");
    fs::write(&junk, b"this is not a tarball at all").unwrap();
    let err = builder
        .build(&Source::DockerArchive(junk), &mut |_| {})
        .unwrap_err();
    assert!(matches!(err, BuildError::UnreadableImage { .. }), "{err}");
    let err = builder
        .build(
            &Source::DebianPackages(vec!["bad name".into()]),
            &mut |_| {},
        )
        .unwrap_err();
    assert!(matches!(err, BuildError::InvalidPackageName(_)), "{err}");
}
