//! Text from outside (a socket, a device, another process) as a tool may print it.

use std::borrow::Cow;

/// `text` with its control characters (a newline, an escape sequence, C1 controls) escaped as
/// Rust writes them (`\n`, `\u{1b}`), everything else as it is: a line printed from it stays
/// one line and cannot move the cursor, so it can neither forge nor erase the lines around it.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for character in text.chars() {
        if character.is_control() {
            escaped.extend(character.escape_default());
        } else {
            escaped.push(character);
        }
    }
    Cow::Owned(escaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        // Goal: newlines, ESC, DEL and C1 controls come out escaped; printable text, non-ASCII
        // included, is untouched (and not copied).
        assert_eq!(printable("x\nsession 9\u{1b}[2K\u{7f}\u{85} é"), "x\\nsession 9\\u{1b}[2K\\u{7f}\\u{85} é");
        assert!(matches!(printable("plain ü"), Cow::Borrowed("plain ü")));
    }
}
