//! The model-geometry options every tool takes, and their one parser.
//!
//! A geometry starts from a preset (`--model`), a config file (`--model-config FILE`: a Hugging
//! Face `config.json`, or the same facts under tutti-profile's names), or, with neither, from
//! `--layers`, `--kv-heads` and `--head-dim` together; each of those flags (and `--dtype`,
//! `--tokens-per-block`) then overrides the field it names. Every value is checked: zero,
//! values past 65536, a KV object over 1 GiB and malformed files are refused in words naming the
//! flag or key.

use std::io::Read;
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use objstore::ModelGeometry;
use serde_json::{Map, Value};

/// Largest value of any one geometry field (objstore refuses more).
pub const FIELD_MAX: u32 = 1 << 16;
/// Preset names, for messages.
pub const PRESETS: &str = "llama3-8b, qwen3-32b, llama3-70b";
/// The model tools use when none is named.
pub const DEFAULT_MODEL: &str = "llama3-8b";
/// Tokens per block when nothing says otherwise (vLLM's default).
pub const TOKENS_PER_BLOCK_DEFAULT: u32 = 16;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
            Dtype::Fp8 => 1,
        }
    }

    /// `torch_dtype` values of Hugging Face configs, and our own names.
    fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "bfloat16" | "bf16" => Some(Dtype::Bf16),
            "float16" | "fp16" | "half" => Some(Dtype::Fp16),
            "float32" | "fp32" | "float" => Some(Dtype::Fp32),
            "float8_e4m3fn" | "float8_e4m3fnuz" | "float8_e5m2" | "float8_e5m2fnuz" | "fp8" => Some(Dtype::Fp8),
            _ => None,
        }
    }
}

/// The geometry options; flatten into a tool's arguments with `#[command(flatten)]`.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct GeometryArgs {
    /// Model preset: llama3-8b (Llama-3.1-8B), qwen3-32b, llama3-70b.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// A model's config.json: Hugging Face keys num_hidden_layers, num_key_value_heads, head_dim
    /// (or hidden_size / num_attention_heads), torch_dtype; or tutti-profile's layer_count,
    /// kv_head_count, head_dim, dtype_bytes.
    #[arg(long = "model-config", value_name = "FILE", conflicts_with = "model")]
    pub model_config: Option<PathBuf>,
    /// Transformer layers (overrides the model's).
    #[arg(long, value_name = "N")]
    pub layers: Option<u32>,
    /// KV heads per rank (grouped-query attention; overrides the model's).
    #[arg(long = "kv-heads", value_name = "N")]
    pub kv_heads: Option<u32>,
    /// Elements per head (overrides the model's).
    #[arg(long = "head-dim", value_name = "N")]
    pub head_dim: Option<u32>,
    /// Element type of the KV cache (overrides the model's).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// Tokens per KV block (the engine's block size) [default: 16].
    #[arg(long = "tokens-per-block", visible_alias = "block-tokens", value_name = "N")]
    pub tokens_per_block: Option<u32>,
}

/// The compute side of a model config file (what tutti-profile's roofline model needs beyond the
/// KV geometry); each `None` when the file does not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ComputeShape {
    pub hidden_size: Option<u32>,
    pub attention_heads: Option<u32>,
    pub intermediate_size: Option<u32>,
}

/// A resolved model: its name (a preset's, the config's with control characters escaped, or
/// `custom` once a flag changed it),
/// its validated KV geometry, and what a config file said about compute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChoice {
    pub name: String,
    /// The preset or file the geometry started from (`None` when it came from flags alone).
    pub base: Option<String>,
    pub geometry: ModelGeometry,
    pub compute: ComputeShape,
}

#[derive(Debug, thiserror::Error)]
pub enum GeometryError {
    #[error("unknown model '{name}'; accepted: {PRESETS}, or --model-config FILE, or --layers, --kv-heads and --head-dim")]
    UnknownModel { name: String },
    #[error("no model given; accepted: --model ({PRESETS}), --model-config FILE, or --layers, --kv-heads and --head-dim together")]
    NoModel,
    #[error("--model-config {path}: {reason}")]
    ConfigFile { path: String, reason: String },
    #[error("{what}={value}: {reason}")]
    BadValue { what: String, value: String, reason: String },
}

impl GeometryArgs {
    /// Resolves the options. `default_model` is used when neither `--model` nor `--model-config`
    /// nor all of `--layers`/`--kv-heads`/`--head-dim` are given (`None`: one of them is
    /// required, e.g. for formatting a pool).
    pub fn resolve(&self, default_model: Option<&str>) -> Result<ModelChoice, GeometryError> {
        let from_flags = self.layers.is_some() && self.kv_heads.is_some() && self.head_dim.is_some();
        let (base, mut fields, compute) = match (&self.model, &self.model_config) {
            (Some(name), _) => (Some(name.clone()), preset(name)?, ComputeShape::default()),
            (None, Some(path)) => {
                let file = read_config(path)?;
                (Some(file.name.clone()), file.fields, file.compute)
            }
            (None, None) if from_flags => (None, Fields::default(), ComputeShape::default()),
            (None, None) => match default_model {
                Some(name) => (Some(name.to_string()), preset(name)?, ComputeShape::default()),
                None => return Err(GeometryError::NoModel),
            },
        };
        let mut changed = false;
        for (flag, value, field) in [
            ("--layers", self.layers, &mut fields.layers),
            ("--kv-heads", self.kv_heads, &mut fields.kv_heads),
            ("--head-dim", self.head_dim, &mut fields.head_dim),
        ] {
            if let Some(value) = value {
                check_field(flag, u64::from(value))?;
                changed |= field.as_ref().is_some_and(|old| old.value != value);
                *field = Some(Field { value, source: flag.to_string() });
            }
        }
        if let Some(dtype) = self.dtype {
            changed |= fields.dtype_bytes.as_ref().is_some_and(|old| old.value != dtype.bytes());
            fields.dtype_bytes = Some(Field { value: dtype.bytes(), source: "--dtype".into() });
        }
        let tokens_per_block = self.tokens_per_block.unwrap_or(TOKENS_PER_BLOCK_DEFAULT);
        check_field("--tokens-per-block", u64::from(tokens_per_block))?;
        let missing = |what: &str| GeometryError::BadValue {
            what: "model".into(),
            value: base.clone().unwrap_or_else(|| "custom".into()),
            reason: format!("says nothing about {what}; give it with the flag"),
        };
        let layers = fields.layers.ok_or_else(|| missing("--layers"))?;
        let kv_heads = fields.kv_heads.ok_or_else(|| missing("--kv-heads"))?;
        let head_dim = fields.head_dim.ok_or_else(|| missing("--head-dim"))?;
        let dtype_bytes = fields.dtype_bytes.map_or(Dtype::Bf16.bytes(), |field| field.value);
        let geometry = ModelGeometry {
            layers: layers.value,
            kv_heads: kv_heads.value,
            head_dim: head_dim.value,
            dtype_bytes,
            block_tokens: tokens_per_block,
        };
        geometry.validate().map_err(|error| GeometryError::BadValue {
            what: format!("{} x {} x {}", layers.source, kv_heads.source, head_dim.source),
            value: geometry.to_string(),
            reason: error.to_string(),
        })?;
        let name = match &base {
            Some(base) if !changed => base.clone(),
            _ => "custom".to_string(),
        };
        Ok(ModelChoice { name, base, geometry, compute })
    }

    /// Whether any option other than the tokens per block was given.
    pub fn names_a_model(&self) -> bool {
        self.model.is_some()
            || self.model_config.is_some()
            || self.layers.is_some()
            || self.kv_heads.is_some()
            || self.head_dim.is_some()
            || self.dtype.is_some()
    }
}

impl std::fmt::Display for ModelChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.geometry)
    }
}

/// A geometry field and where it came from (a preset, a config key, a flag), for messages.
#[derive(Debug, Clone)]
struct Field {
    value: u32,
    source: String,
}

#[derive(Debug, Clone, Default)]
struct Fields {
    layers: Option<Field>,
    kv_heads: Option<Field>,
    head_dim: Option<Field>,
    dtype_bytes: Option<Field>,
}

fn preset(name: &str) -> Result<Fields, GeometryError> {
    let geometry = ModelGeometry::preset(&name.to_ascii_lowercase(), TOKENS_PER_BLOCK_DEFAULT)
        .ok_or_else(|| GeometryError::UnknownModel { name: name.to_string() })?;
    let field = |value: u32| Some(Field { value, source: format!("--model={name}") });
    Ok(Fields {
        layers: field(geometry.layers),
        kv_heads: field(geometry.kv_heads),
        head_dim: field(geometry.head_dim),
        dtype_bytes: field(geometry.dtype_bytes),
    })
}

fn check_field(what: &str, value: u64) -> Result<u32, GeometryError> {
    let bad = |reason: String| GeometryError::BadValue { what: what.to_string(), value: value.to_string(), reason };
    if value == 0 {
        return Err(bad("must be at least 1".into()));
    }
    if value > u64::from(FIELD_MAX) {
        return Err(bad(format!("is larger than any model has; accepted: 1..={FIELD_MAX}")));
    }
    Ok(value as u32)
}

/// What a model config file says.
struct ConfigFile {
    name: String,
    fields: Fields,
    compute: ComputeShape,
}

/// Largest config file read (a config.json is a few KiB; this refuses a wrong file early).
const CONFIG_BYTES_MAX: u64 = 1 << 20;

fn read_config(path: &Path) -> Result<ConfigFile, GeometryError> {
    let fail = |reason: String| GeometryError::ConfigFile { path: path.display().to_string(), reason };
    // The length of a device or pipe says nothing (0 for /dev/zero), so only regular files are
    // read, and at most one byte past the cap. Asked before opening (a device is not opened at
    // all) and again of the file opened without waiting (it may have been replaced meanwhile,
    // by a FIFO too: [`open_config`]).
    let not_regular = || fail("is not a regular file; a model config is a small JSON file (config.json)".into());
    let is_file = |metadata: std::io::Result<std::fs::Metadata>| {
        metadata.map(|metadata| metadata.is_file()).map_err(|error| fail(format!("cannot read it: {error}")))
    };
    if !is_file(std::fs::metadata(path))? {
        return Err(not_regular());
    }
    let file = open_config(path)?;
    let mut bytes = Vec::new();
    file.take(CONFIG_BYTES_MAX + 1).read_to_end(&mut bytes).map_err(|error| fail(format!("cannot read it: {error}")))?;
    if bytes.len() as u64 > CONFIG_BYTES_MAX {
        return Err(fail(format!(
            "is more than {CONFIG_BYTES_MAX} bytes; a model config is a small JSON file (at most {CONFIG_BYTES_MAX} bytes)"
        )));
    }
    let text = String::from_utf8(bytes).map_err(|error| fail(format!("is not UTF-8 text: {error}")))?;
    let stem = path.file_stem().map(|stem| stem.to_string_lossy().into_owned()).unwrap_or_else(|| "config".into());
    parse_config(&text, &stem).map_err(fail)
}

/// Opens the config file at `path` to be read, refusing anything but a regular file. The open
/// does not wait (`O_NONBLOCK`): a FIFO put at the path after [`read_config`] looked would
/// otherwise block it until a writer came, without end; it is refused on the descriptor opened.
/// A regular file's reads ignore the flag.
fn open_config(path: &Path) -> Result<std::fs::File, GeometryError> {
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |reason: String| GeometryError::ConfigFile { path: path.display().to_string(), reason };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|error| fail(format!("cannot read it: {error}")))?;
    match file.metadata() {
        Ok(metadata) if metadata.is_file() => Ok(file),
        Ok(_) => Err(fail("is not a regular file; a model config is a small JSON file (config.json)".into())),
        Err(error) => Err(fail(format!("cannot read it: {error}"))),
    }
}

/// Parses a config's text; `fallback_name` names it when it names itself nowhere.
fn parse_config(text: &str, fallback_name: &str) -> Result<ConfigFile, String> {
    let value: Value = serde_json::from_str(text).map_err(|error| format!("is not JSON: {error}"))?;
    let Value::Object(top) = value else { return Err("is not a JSON object of model parameters".into()) };
    // Multimodal configs keep the language model's numbers under text_config.
    let object = match top.get("text_config") {
        Some(Value::Object(text_config)) if !has_any(&top, LAYER_KEYS) => text_config,
        _ => &top,
    };
    let layers = number(object, LAYER_KEYS)?;
    let attention_heads = number(object, &["num_attention_heads", "head_count"])?;
    let hidden_size = number(object, &["hidden_size"])?;
    let kv_heads =
        number(object, &["num_key_value_heads", "kv_head_count"])?.or(attention_heads.map(|(_, heads)| ("num_attention_heads", heads)));
    let head_dim = match number(object, &["head_dim"])? {
        Some(found) => Some(found),
        None => match (hidden_size, attention_heads) {
            (Some((_, hidden)), Some((_, heads))) if hidden % heads == 0 => Some(("hidden_size / num_attention_heads", hidden / heads)),
            (Some((_, hidden)), Some((_, heads))) => {
                return Err(format!("has no head_dim, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"))
            }
            _ => None,
        },
    };
    let dtype_bytes = match dtype_entry(object)? {
        Some(found) => Some(found),
        None => match number(object, &["dtype_bytes"])? {
            // The element sizes --dtype names: fp8, bf16/fp16, fp32.
            Some((key, bytes @ (1 | 2 | 4))) => Some((key, bytes)),
            Some((key, bytes)) => return Err(format!("{key} is {bytes}; accepted: 1 (fp8), 2 (bf16, fp16) or 4 (fp32)")),
            None => None,
        },
    };
    let field = |found: Option<(&str, u32)>| found.map(|(key, value)| Field { value, source: format!("--model-config key {key}") });
    let name = ["name", "_name_or_path", "model_type"]
        .iter()
        .find_map(|key| object.get(*key).or_else(|| top.get(*key)).and_then(Value::as_str).filter(|name| !name.is_empty()))
        .unwrap_or(fallback_name);
    // The name is printed in headers, refusals and SVG titles: a newline or an escape sequence in
    // a config (or its file name) is kept escaped, so it cannot forge or erase lines.
    let name = crate::printable(name).into_owned();
    Ok(ConfigFile {
        name,
        fields: Fields { layers: field(layers), kv_heads: field(kv_heads), head_dim: field(head_dim), dtype_bytes: field(dtype_bytes) },
        compute: ComputeShape {
            hidden_size: hidden_size.map(|(_, value)| value),
            attention_heads: attention_heads.map(|(_, value)| value),
            intermediate_size: number(object, &["intermediate_size"])?.map(|(_, value)| value),
        },
    })
}

const LAYER_KEYS: &[&str] = &["num_hidden_layers", "layer_count"];

fn has_any(object: &Map<String, Value>, keys: &[&str]) -> bool {
    keys.iter().any(|key| object.contains_key(*key))
}

/// The first of `keys` present, as a whole number in 1..=FIELD_MAX (`null` counts as absent).
fn number<'k>(object: &Map<String, Value>, keys: &[&'k str]) -> Result<Option<(&'k str, u32)>, String> {
    for key in keys {
        match object.get(*key) {
            None | Some(Value::Null) => continue,
            Some(value) => {
                let number = value.as_u64().filter(|number| (1..=u64::from(FIELD_MAX)).contains(number));
                return match number {
                    Some(number) => Ok(Some((key, number as u32))),
                    None => Err(format!("{key} is {value}; accepted: a whole number from 1 to {FIELD_MAX}")),
                };
            }
        }
    }
    Ok(None)
}

/// `torch_dtype` (or the newer `dtype`) as element bytes.
fn dtype_entry(object: &Map<String, Value>) -> Result<Option<(&'static str, u32)>, String> {
    for key in ["torch_dtype", "dtype"] {
        match object.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::String(name)) => {
                return Dtype::from_name(name)
                    .map(|dtype| Some((key, dtype.bytes())))
                    .ok_or_else(|| format!("{key} is \"{name}\"; accepted: bfloat16, float16, float32, float8_e4m3fn, float8_e5m2"))
            }
            Some(value) => return Err(format!("{key} is {value}; accepted: a type name such as \"bfloat16\"")),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> GeometryArgs {
        GeometryArgs::default()
    }

    #[test]
    fn a_config_path_that_is_not_a_regular_file_is_refused() {
        // Goal: the 1 MiB cap used the file's length, which is 0 for /dev/zero or a FIFO, so
        // --model-config /dev/zero read without end; such paths are refused by what they are.
        for path in ["/dev/null", "/dev/zero"] {
            if !Path::new(path).exists() {
                continue;
            }
            let error = read_config(Path::new(path)).err().expect("refused").to_string();
            assert!(error.contains("is not a regular file"), "{path}: {error}");
        }
        let directory = std::env::temp_dir();
        let error = read_config(&directory).err().expect("refused").to_string();
        assert!(error.contains("is not a regular file"), "{error}");
        // A FIFO is refused without opening it (an open would wait for a writer).
        let fifo = directory.join(format!("tutti-cli-config-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&fifo);
        if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|status| status.success()) {
            let error = read_config(&fifo).err().expect("refused").to_string();
            let _ = std::fs::remove_file(&fifo);
            assert!(error.contains("is not a regular file"), "{error}");
        }
    }

    #[test]
    fn a_config_file_over_the_cap_is_refused_without_reading_past_it() {
        let path = std::env::temp_dir().join(format!("tutti-cli-config-cap-{}.json", std::process::id()));
        std::fs::write(&path, vec![b' '; CONFIG_BYTES_MAX as usize + 1]).unwrap();
        let error = read_config(&path).err().expect("refused").to_string();
        let _ = std::fs::remove_file(&path);
        assert!(error.contains("at most 1048576 bytes"), "{error}");
    }

    #[test]
    fn presets_and_the_default_give_the_briefs_geometries() {
        let llama = args().resolve(Some("llama3-8b")).unwrap();
        assert_eq!(llama.geometry, ModelGeometry::llama3_8b(16));
        assert_eq!(llama.name, "llama3-8b");
        let qwen = GeometryArgs { model: Some("qwen3-32b".into()), tokens_per_block: Some(32), ..args() }.resolve(None).unwrap();
        assert_eq!(qwen.geometry, ModelGeometry::qwen3_32b(32));
        let error = GeometryArgs { model: Some("gpt-5".into()), ..args() }.resolve(None).unwrap_err().to_string();
        assert!(error.contains("unknown model 'gpt-5'") && error.contains("llama3-8b"), "{error}");
        assert!(matches!(args().resolve(None), Err(GeometryError::NoModel)));
    }

    #[test]
    fn flags_give_any_geometry_and_override_a_preset() {
        // Goal: a model that is no preset, by flags alone; flags on a preset make it "custom".
        let custom = GeometryArgs { layers: Some(40), kv_heads: Some(4), head_dim: Some(64), dtype: Some(Dtype::Fp8), ..args() };
        let choice = custom.resolve(None).unwrap();
        assert_eq!(choice.geometry, ModelGeometry { layers: 40, kv_heads: 4, head_dim: 64, dtype_bytes: 1, block_tokens: 16 });
        assert_eq!(choice.name, "custom");
        let more_layers = GeometryArgs { model: Some("llama3-8b".into()), layers: Some(48), ..args() }.resolve(None).unwrap();
        assert_eq!((more_layers.name.as_str(), more_layers.geometry.layers, more_layers.geometry.kv_heads), ("custom", 48, 8));
        // Restating a preset's own value keeps its name.
        let same = GeometryArgs { layers: Some(32), ..args() }.resolve(Some("llama3-8b")).unwrap();
        assert_eq!(same.name, "llama3-8b");
    }

    #[test]
    fn zero_huge_and_absurd_values_are_refused_in_words() {
        let message = |geometry: GeometryArgs| geometry.resolve(Some("llama3-8b")).unwrap_err().to_string();
        assert_eq!(message(GeometryArgs { head_dim: Some(0), ..args() }), "--head-dim=0: must be at least 1");
        assert!(message(GeometryArgs { layers: Some(70_000), ..args() }).contains("--layers=70000: is larger than any model has"));
        assert!(message(GeometryArgs { tokens_per_block: Some(0), ..args() }).starts_with("--tokens-per-block=0"));
        // Every field allowed, but one object (a layer's K of one block) past 1 GiB.
        let absurd = GeometryArgs { kv_heads: Some(1024), head_dim: Some(1024), tokens_per_block: Some(1024), ..args() };
        let text = message(absurd);
        assert!(text.contains("exceeds 1 GiB") && text.contains("--kv-heads"), "{text}");
    }

    #[test]
    fn hugging_face_configs_give_the_geometry() {
        // Goal: Llama-3.1-8B's config.json (relevant keys) gives the preset's geometry; a config
        // without head_dim derives it; one without num_key_value_heads is multi-head attention.
        let llama = r#"{"_name_or_path": "meta-llama/Llama-3.1-8B", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "torch_dtype": "bfloat16", "head_dim": null}"#;
        let file = parse_config(llama, "config").unwrap();
        assert_eq!(file.name, "meta-llama/Llama-3.1-8B");
        assert_eq!(
            (file.fields.layers.unwrap().value, file.fields.kv_heads.unwrap().value, file.fields.head_dim.unwrap().value),
            (32, 8, 128)
        );
        assert_eq!(file.compute.intermediate_size, Some(14336));
        let mha =
            parse_config(r#"{"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "torch_dtype": "float32"}"#, "gpt2")
                .unwrap();
        assert_eq!((mha.name.as_str(), mha.fields.kv_heads.unwrap().value, mha.fields.head_dim.unwrap().value), ("gpt2", 12, 64));
        assert_eq!(mha.fields.dtype_bytes.unwrap().value, 4);
        let nested =
            parse_config(r#"{"model_type": "vlm", "text_config": {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8}}"#, "x")
                .unwrap();
        assert_eq!(nested.fields.layers.unwrap().value, 2);
    }

    #[test]
    fn a_config_name_with_control_characters_is_kept_escaped() {
        // Goal: a config's name is printed by every tool (headers, refusals): a newline and an
        // escape sequence in it cannot forge lines.
        let text = r#"{"name":"x\n\u001b[2Kfake line: verify OK","num_hidden_layers":2,"num_key_value_heads":8,"head_dim":128}"#;
        let file = parse_config(text, "fallback").unwrap();
        assert_eq!(file.name, "x\\n\\u{1b}[2Kfake line: verify OK");
        assert_eq!(parse_config(r#"{"num_hidden_layers":2,"num_key_value_heads":8,"head_dim":128}"#, "a\tb").unwrap().name, "a\\tb");
    }

    #[test]
    fn a_fifo_put_in_place_of_the_config_is_refused_without_waiting() {
        // Goal: read_config asks whether the path is a regular file, then opens it; a FIFO put
        // there in between made the open wait for a writer, without end. The open itself
        // does not wait (O_NONBLOCK), and what it opened is refused as not a regular file.
        let directory = tempfile::tempdir().unwrap();
        let fifo = directory.path().join("config.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|status| status.success()) {
            eprintln!("skipped: mkfifo is not there to make a FIFO");
            return;
        }
        let (sender, receiver) = std::sync::mpsc::channel();
        let opening = fifo.clone();
        // Left behind if it hangs (the test fails; the process ends with it).
        std::thread::spawn(move || sender.send(open_config(&opening).map(drop).map_err(|error| error.to_string())));
        let opened = receiver.recv_timeout(std::time::Duration::from_secs(10)).expect("opening a FIFO waited for a writer");
        let error = opened.expect_err("a FIFO was opened as a config");
        assert!(error.contains("is not a regular file"), "{error}");
    }

    #[test]
    fn bad_config_files_say_what_is_wrong() {
        for (text, needle) in [
            ("not json", "is not JSON"),
            ("[1, 2]", "not a JSON object"),
            (r#"{"num_hidden_layers": -3}"#, "num_hidden_layers is -3; accepted: a whole number from 1 to 65536"),
            (r#"{"num_hidden_layers": 2.5}"#, "num_hidden_layers is 2.5"),
            (r#"{"torch_dtype": "int4"}"#, "torch_dtype is \"int4\""),
            (r#"{"dtype_bytes": 3}"#, "dtype_bytes is 3; accepted: 1 (fp8), 2 (bf16, fp16) or 4 (fp32)"),
            (r#"{"dtype_bytes": 65536}"#, "dtype_bytes is 65536; accepted: 1 (fp8)"),
            (r#"{"hidden_size": 100, "num_attention_heads": 3}"#, "not a multiple"),
        ] {
            let error = parse_config(text, "c").err().unwrap_or_else(|| panic!("{text} accepted"));
            assert!(error.contains(needle), "{text}: {error}");
        }
        // A file that lacks a field names the flag that gives it.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("partial.json");
        std::fs::write(&path, r#"{"num_hidden_layers": 4, "torch_dtype": "bfloat16"}"#).unwrap();
        let partial = GeometryArgs { model_config: Some(path.clone()), ..args() };
        let error = partial.resolve(None).unwrap_err().to_string();
        assert!(error.contains("says nothing about --kv-heads"), "{error}");
        let completed = GeometryArgs { kv_heads: Some(2), head_dim: Some(64), ..partial };
        assert_eq!(completed.resolve(None).unwrap().geometry.layers, 4);
        let missing = GeometryArgs { model_config: Some(directory.path().join("absent.json")), ..args() };
        assert!(missing.resolve(None).unwrap_err().to_string().contains("cannot read it"));
    }
}
