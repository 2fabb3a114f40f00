//! tutti-bench (being written).
fn main() -> anyhow::Result<()> {
    anyhow::bail!("tutti-bench is not implemented yet")
}
