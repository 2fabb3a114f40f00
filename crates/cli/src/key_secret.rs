//! `--key-secret-file`: the pool's key secret, read for `tutti pool format` and `tuttid --format`.

use std::path::Path;

use objstore::hash::KeySecret;

use crate::exit::Unusable;
use crate::printable;

/// The secret of `--key-secret-file` (64 hex digits; see `KeySecret::read_file`). A file that
/// others may read or write, or that another user owns, is used, with a warning on standard
/// error: they could compute every key of the pool, or plant a secret they know. Errors never
/// print the file's text, and print its path escaped, as the warning does (a path is the
/// operator's text, but may hold control characters).
pub fn read_key_secret_file(path: &Path) -> Result<KeySecret, Unusable> {
    let file = KeySecret::read_file(path).map_err(|error| Unusable(format!("--key-secret-file: {}", printable(&error.to_string()))))?;
    if let Some(exposure) = file.exposure() {
        crate::errln!(
            "warning: the key secret file {} is {exposure}: whoever reads it can compute the pool's block keys, whoever writes it can plant a secret they know; chmod 600 it, owned by the user who formats",
            printable(&path.display().to_string()),
        );
    }
    Ok(file.secret)
}
