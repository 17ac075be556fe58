//! `--only images`: task images of 1-4 GiB (tests/support/task_images.py,
//! served by Debian's `docker-registry` on loopback) pulled and converted
//! into chains of stored layers, as a node's create by image does
//! (`template_build::registry::pull`, `Builder::build_layered`), each on a
//! cold cache; the same pulled image converted by the whole-image path
//! (`Builder::build` of the blobs: the tree unpacked, one ext4 made of it)
//! as the reference; and the disk 1, 4 and 16 images sharing their base
//! layers take in one layer store, against the bytes of their distinct
//! layers. No guest runs: the conversion is the node's work before a boot.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde_json::{Value, json};
use template_build::registry::{self, PullOptions, Reference};
use template_build::{Builder, Source};

use super::median;

/// The images `task_images.py` makes, and their layers.
#[derive(Debug, Deserialize)]
pub struct Catalogue {
    pub images: BTreeMap<String, CatalogueImage>,
}

#[derive(Debug, Deserialize)]
pub struct CatalogueImage {
    pub reference: String,
    /// Bytes of its layers' tars (uncompressed).
    pub bytes: u64,
    pub layers: Vec<CatalogueLayer>,
}

#[derive(Debug, Deserialize)]
pub struct CatalogueLayer {
    pub digest: String,
    pub diff_size: u64,
}

impl Catalogue {
    pub fn read(entry: &Path) -> Result<Catalogue> {
        let path = entry.join("images.json");
        let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_slice(&text).with_context(|| format!("parsing {}", path.display()))
    }

    fn image(&self, name: &str) -> Result<&CatalogueImage> {
        self.images
            .get(name)
            .with_context(|| format!("no image {name} in the task images"))
    }

    /// The uncompressed bytes of the distinct layers of `names`.
    pub fn distinct_bytes(&self, names: &[&str]) -> Result<u64> {
        let mut seen = BTreeMap::new();
        for name in names {
            for l in &self.image(name)?.layers {
                seen.insert(l.digest.as_str(), l.diff_size);
            }
        }
        Ok(seen.values().sum())
    }
}

/// The task images' cache entry: made (once; minutes) or found by
/// tests/support/task_images.py of this source tree.
pub fn task_images() -> Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/support/task_images.py");
    eprintln!(
        "bench: images: {} (makes the images once)",
        script.display()
    );
    let out = Command::new("python3")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The images sharing one base: the 1 GiB one and the variants.
pub fn sharing(catalogue: &Catalogue, n: usize) -> Vec<&str> {
    let mut names = vec!["swe-1g"];
    names.extend(
        catalogue
            .images
            .keys()
            .filter(|k| k.starts_with("var-"))
            .map(String::as_str),
    );
    names.truncate(n);
    names
}

pub struct ImagesBench<'a> {
    /// The task images' cache entry (`task_images.py` prints it).
    pub entry: &'a Path,
    /// The guest agent every conversion installs.
    pub agent: &'a Path,
    /// Where the cold caches go (a local filesystem with ~12 GB free).
    pub scratch: &'a Path,
    /// Cold conversions per image size.
    pub runs: usize,
}

/// `docker-registry` serving the task images' store on a free loopback
/// port; killed when dropped.
pub(crate) struct Registry {
    child: Child,
    pub(crate) host: String,
    _dir: tempfile::TempDir,
}

impl Registry {
    pub(crate) fn start(storage: &Path) -> Result<Registry> {
        let dir = tempfile::tempdir().context("creating the registry's directory")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  maintenance:\n    \
                 uploadpurging:\n      enabled: false\n    readonly:\n      enabled: true\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                storage.display()
            ),
        )?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting docker-registry (Debian's package; scripts/deps.sh installs it)")?;
        let mut registry = Registry {
            child,
            host: format!("127.0.0.1:{port}"),
            _dir: dir,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if started.elapsed() > Duration::from_secs(30) {
                let _ = registry.child.kill();
                bail!("docker-registry did not listen on {port} within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Bytes the files of `dir` take on disk (blocks allocated, so sparse
/// layers count what they hold).
pub fn disk_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            total += meta.blocks() * 512;
        }
    }
    Ok(total)
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round()
}

/// `{"p50", "samples"}` of a figure.
fn figure(samples: &[f64]) -> Value {
    let mut sorted = samples.to_vec();
    json!({"p50": median(&mut sorted), "samples": samples})
}

impl ImagesBench<'_> {
    pub async fn measure(&self) -> Result<Value> {
        let catalogue = Catalogue::read(self.entry)?;
        let registry = Registry::start(&self.entry.join("storage"))?;
        eprintln!(
            "bench: images: task images of {} served at {}",
            self.entry.display(),
            registry.host
        );
        std::fs::create_dir_all(self.scratch)
            .with_context(|| format!("creating {}", self.scratch.display()))?;
        let mut report = json!({});
        let mut detail = json!({});
        for (size, name) in [("1g", "swe-1g"), ("4g", "swe-4g")] {
            let image = catalogue.image(name)?;
            let mut pull_convert = Vec::new();
            let mut pull = Vec::new();
            let mut whole = Vec::new();
            let mut layered = Vec::new();
            for run in 1..=self.runs {
                let sample = self.cold(&registry, image).await?;
                eprintln!(
                    "bench: images: {name} {run}/{}: pull {:.0} ms, layered {:.0} ms, \
                     whole-image {:.0} ms",
                    self.runs, sample.pull_ms, sample.layered_ms, sample.whole_ms
                );
                pull_convert.push(sample.pull_ms + sample.layered_ms);
                pull.push(sample.pull_ms);
                layered.push(sample.layered_ms);
                whole.push(sample.whole_ms);
            }
            report["image_pull_convert_ms"][size] = figure(&pull_convert);
            let ratios: Vec<f64> = layered.iter().zip(&whole).map(|(l, w)| l / w).collect();
            report["image_convert_ratio_vs_reference"][size] = figure(&ratios);
            detail[size] = json!({
                "image": image.reference,
                "bytes": image.bytes,
                "pull_ms": figure(&pull),
                "convert_layered_ms": figure(&layered),
                "reference_whole_image_convert_ms": figure(&whole),
            });
        }
        self.disk(&registry, &catalogue, &mut report, &mut detail)
            .await?;
        report["image_detail"] = detail;
        Ok(report)
    }

    /// A fresh build cache under the scratch directory, removed when dropped.
    fn cold_cache(&self) -> Result<(tempfile::TempDir, Builder)> {
        let dir = tempfile::Builder::new()
            .prefix("images-bench-")
            .tempdir_in(self.scratch)
            .context("creating a cold cache")?;
        let builder = Builder::new(self.agent)
            .cache_dir(dir.path())
            .scratch_dir(dir.path().join("scratch"));
        Ok((dir, builder))
    }

    async fn pull(
        &self,
        registry: &Registry,
        builder: &Builder,
        image: &CatalogueImage,
    ) -> Result<(registry::Pulled, Duration)> {
        let reference = Reference::parse(&format!("{}/{}", registry.host, image.reference))?;
        let started = Instant::now();
        let pulled = registry::pull(
            &builder.images_dir(),
            &reference,
            &PullOptions::default(),
            &mut |_| {},
        )
        .await
        .with_context(|| format!("pulling {reference}"))?;
        Ok((pulled, started.elapsed()))
    }

    /// One cold pull and layered conversion, then the whole-image
    /// conversion of the same blobs in another cold cache.
    async fn cold(&self, registry: &Registry, image: &CatalogueImage) -> Result<Sample> {
        let (dir, builder) = self.cold_cache()?;
        let (pulled, pull_took) = self.pull(registry, &builder, image).await?;
        let store = pulled.store.clone();
        let manifest = pulled.manifest_digest.clone();
        let started = Instant::now();
        let b = builder.clone();
        let (s, m) = (store.clone(), manifest.clone());
        tokio::task::spawn_blocking(move || b.build_layered(&s, &m, &mut |_| {}))
            .await?
            .context("converting into layers")?;
        let layered_took = started.elapsed();
        // The layers go before the reference runs: one image's bytes at a time.
        std::fs::remove_dir_all(builder.layers_dir())?;
        let (whole_dir, whole_builder) = self.cold_cache()?;
        let source = Source::OciBlobs {
            dir: store,
            manifest,
        };
        let started = Instant::now();
        tokio::task::spawn_blocking(move || whole_builder.build(&source, &mut |_| {}))
            .await?
            .context("converting into one whole image (the reference)")?;
        let whole_took = started.elapsed();
        drop(whole_dir);
        drop(dir);
        Ok(Sample {
            pull_ms: ms(pull_took),
            layered_ms: ms(layered_took),
            whole_ms: ms(whole_took),
        })
    }

    /// 16 images sharing a base into one store: its bytes after 1, 4 and
    /// 16, and after 16 against their distinct layers' bytes.
    async fn disk(
        &self,
        registry: &Registry,
        catalogue: &Catalogue,
        report: &mut Value,
        detail: &mut Value,
    ) -> Result<()> {
        let names = sharing(catalogue, 16);
        if names.len() < 16 {
            bail!(
                "the task images have {} images sharing a base, not 16",
                names.len()
            );
        }
        let (_dir, builder) = self.cold_cache()?;
        let mut convert_ms = Vec::new();
        for (n, name) in names.iter().enumerate() {
            let (pulled, _) = self
                .pull(registry, &builder, catalogue.image(name)?)
                .await?;
            let b = builder.clone();
            let started = Instant::now();
            tokio::task::spawn_blocking(move || {
                b.build_layered(&pulled.store, &pulled.manifest_digest, &mut |_| {})
            })
            .await?
            .with_context(|| format!("converting {name}"))?;
            convert_ms.push(ms(started.elapsed()));
            let count = n + 1;
            if [1, 4, 16].contains(&count) {
                let bytes = disk_bytes(&builder.layers_dir())?;
                let distinct = catalogue.distinct_bytes(&names[..count])?;
                eprintln!("bench: images: {count} sharing a base: {bytes} bytes stored");
                report[format!("image_disk_bytes_{count}")] = json!(bytes);
                detail[format!("distinct_layer_bytes_{count}")] = json!(distinct);
                if count == 16 {
                    report["image_disk_16_vs_unique"] = json!(bytes as f64 / distinct as f64);
                }
            }
        }
        detail["sharing_convert_ms"] = json!({"samples": convert_ms, "images": names});
        Ok(())
    }
}

struct Sample {
    pull_ms: f64,
    layered_ms: f64,
    whole_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalogue() -> Catalogue {
        let layer = |what: &str, size: u64| CatalogueLayer {
            digest: format!("sha256:{what}"),
            diff_size: size,
        };
        let mut images = BTreeMap::new();
        images.insert(
            "swe-1g".into(),
            CatalogueImage {
                reference: "task/swe-1g:v1".into(),
                bytes: 110,
                layers: vec![layer("base", 100), layer("repo-00", 10)],
            },
        );
        for n in 1..=2 {
            images.insert(
                format!("var-{n:02}"),
                CatalogueImage {
                    reference: format!("task/var-{n:02}:v1"),
                    bytes: 100 + n,
                    layers: vec![layer("base", 100), layer(&format!("repo-{n:02}"), n)],
                },
            );
        }
        Catalogue { images }
    }

    #[test]
    fn distinct_bytes_count_a_shared_layer_once() {
        let c = catalogue();
        let names = sharing(&c, 16);
        assert_eq!(names, ["swe-1g", "var-01", "var-02"]);
        assert_eq!(c.distinct_bytes(&names).unwrap(), 100 + 10 + 1 + 2);
        assert_eq!(c.distinct_bytes(&names[..1]).unwrap(), 110);
        assert!(c.distinct_bytes(&["nope"]).is_err());
    }

    /// The bench's registry serves a store read-only: the task images'
    /// cache entry is never written by a pull.
    #[test]
    fn the_registry_serves_its_store_read_only() {
        use std::io::{Read, Write};
        let store = tempfile::tempdir().unwrap();
        let registry = Registry::start(store.path()).unwrap();
        let ask = |request: &str| {
            let mut c = std::net::TcpStream::connect(&registry.host).unwrap();
            c.write_all(request.as_bytes()).unwrap();
            let mut answer = String::new();
            c.read_to_string(&mut answer).unwrap();
            answer
        };
        let base = ask("GET /v2/ HTTP/1.0\r\n\r\n");
        assert!(base.starts_with("HTTP/1.0 200"), "{base}");
        let upload = ask("POST /v2/task/x/blobs/uploads/ HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
        assert!(!upload.starts_with("HTTP/1.0 202"), "{upload}");
        assert_eq!(std::fs::read_dir(store.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_figure_keeps_its_samples() {
        let f = figure(&[3.0, 1.0, 2.0]);
        assert_eq!(f["p50"], 2.0);
        assert_eq!(f["samples"], json!([3.0, 1.0, 2.0]));
    }

    #[test]
    fn disk_bytes_count_blocks_held() {
        let dir = tempfile::tempdir().unwrap();
        let sparse = std::fs::File::create(dir.path().join("a.layer")).unwrap();
        sparse.set_len(64 << 20).unwrap();
        std::fs::write(dir.path().join("b.layer"), vec![1u8; 1 << 20]).unwrap();
        let bytes = disk_bytes(dir.path()).unwrap();
        assert!(((1 << 20)..(2 << 20)).contains(&bytes), "{bytes}");
    }
}
