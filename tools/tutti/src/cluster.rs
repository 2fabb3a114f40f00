//! `tutti cluster status`: the cluster tier as etcd holds it (crates/cluster, docs/cluster.md):
//! members and their leases, segments per node, replica counts (in all, and per holder set:
//! which nodes hold how many segments), members whose pools' key secrets differ (they share
//! nothing), refused entries.
//!
//! Exit status: 2 for unusable options (a bad cluster id, segment size, timeout or etcd URL), 1 when etcd
//! does not answer within the timeout, 0 otherwise.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use tutti_cli::outln;
use tutti_cluster::{ClusterClient, ClusterConfig, ClusterError, ClusterId, ClusterStatus, MemberStatus, SegmentBlocks, FORMAT_VERSION};
use tutti_devices::format_size;

use crate::Unusable;

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// Members (address, capacity, lease and its TTL left, key secret tag), segments per node,
    /// replica counts.
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// An etcd client URL, http://HOST:PORT (e.g. http://127.0.0.1:2379; plain http, no TLS);
    /// repeat for every member.
    #[arg(long = "etcd", required = true)]
    endpoints: Vec<String>,
    /// The cluster id the nodes joined with.
    #[arg(long, default_value = "tutti")]
    cluster: String,
    /// Blocks per segment in this cluster (registrations of another size are counted as refused).
    #[arg(long, default_value_t = 32)]
    segment_blocks: u16,
    /// The longest each request to etcd may wait, in milliseconds: 10..=60000. Status holds no
    /// lease, so no lease TTL bounds it.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    timeout_ms: u64,
}

pub fn run(command: &ClusterCommand) -> Result<()> {
    match command {
        ClusterCommand::Status(args) => status(args),
    }
}

fn unusable(error: ClusterError) -> anyhow::Error {
    match error {
        ClusterError::InvalidSetting(_) => Unusable(error.to_string()).into(),
        error => error.into(),
    }
}

fn status(args: &StatusArgs) -> Result<()> {
    let cluster = ClusterId::new(&args.cluster).map_err(unusable)?;
    let segment_blocks = SegmentBlocks::new(args.segment_blocks).map_err(unusable)?;
    let mut config = ClusterConfig::new(args.endpoints.clone(), cluster, segment_blocks);
    config.request_timeout = Duration::from_millis(args.timeout_ms);
    let client = ClusterClient::connect(config).map_err(unusable)?;
    let status = client.status()?;
    print_status(&args.cluster, &status)
}

/// One member's line of the status table.
fn member_line(member: &MemberStatus) -> String {
    let ttl = member.ttl_left_s.map_or_else(|| "expired".to_owned(), |ttl| format!("{ttl} s"));
    format!(
        "  {:<20} {:<24} {:>10} {:>18} {:>8} {:>10} {:>6} {:>10}",
        member.record.node.as_str(),
        // As its node wrote it to etcd, uninterpreted (a node id is checked, an address is not).
        tutti_cli::printable(&member.record.address),
        format_size(member.record.capacity_bytes),
        format!("{:#x}", member.lease_id),
        ttl,
        member.segments,
        member.record.fingerprints.len(),
        member.record.key_secret_tag.to_string()
    )
}

/// What the status says when members' pools have different key secrets: each group of one
/// tag (the largest first), and what to do. None when they all agree.
fn key_secret_lines(status: &ClusterStatus) -> Option<Vec<String>> {
    let groups = status.key_secret_groups();
    if groups.len() < 2 {
        return None;
    }
    let mut lines = vec![format!(
        "WARNING: the members' pools have {} different key secrets; members of different secrets share no segments (the same prompt has other block keys on each side):",
        groups.len()
    )];
    for (tag, nodes) in &groups {
        let nodes: Vec<&str> = nodes.iter().map(|node| node.as_str()).collect();
        lines.push(format!("  key secret {tag}: {}", nodes.join(" ")));
    }
    lines.push("  format every node's pool with the cluster's one --key-secret-file (docs/cluster.md, \"Running a fleet\")".to_owned());
    Some(lines)
}

fn print_status(cluster: &str, status: &ClusterStatus) -> Result<()> {
    outln!("cluster {cluster} (registry format v{FORMAT_VERSION}): {} members", status.members.len())?;
    if !status.members.is_empty() {
        outln!(
            "  {:<20} {:<24} {:>10} {:>18} {:>8} {:>10} {:>6} {:>10}",
            "node",
            "address",
            "capacity",
            "lease",
            "ttl left",
            "segments",
            "models",
            "key secret"
        )?;
    }
    for member in &status.members {
        outln!("{}", member_line(member))?;
    }
    for line in key_secret_lines(status).unwrap_or_default() {
        outln!("{line}")?;
    }
    outln!("segments: {} distinct, {} holder entries", status.distinct_segments, status.holder_entries)?;
    let replicas: Vec<String> = status.replicas.iter().map(|(count, segments)| format!("{count}x: {segments}")).collect();
    outln!("replicas: {}", if replicas.is_empty() { "none".to_owned() } else { replicas.join(", ") })?;
    if !status.holder_sets.is_empty() {
        outln!("segments per holder set (replicas = nodes):")?;
    }
    for set in &status.holder_sets {
        let nodes: Vec<&str> = set.nodes.iter().map(|node| node.as_str()).collect();
        outln!("  {:>8} segment(s), {} replica(s): {}", set.segments, set.nodes.len(), nodes.join(" "))?;
    }
    if status.other_holder_sets > 0 {
        outln!("  … and {} smaller holder set(s)", status.other_holder_sets)?;
    }
    if status.holders_without_member > 0 {
        outln!("holder entries of nodes that are not members: {}", status.holders_without_member)?;
    }
    outln!(
        "refused entries: {} (malformed or foreign); keys of another format version: {}",
        status.skipped_entries,
        status.other_version_keys
    )?;
    if status.truncated {
        outln!("(the scan stopped at its bound; counts are partial)")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutti_cluster::{KeySecretTag, MemberRecord, NodeId};

    fn member(node: &str, tag: [u8; 4]) -> MemberStatus {
        MemberStatus {
            record: MemberRecord {
                node: NodeId::new(node).unwrap(),
                key_secret_tag: KeySecretTag::new(tag),
                address: "10.0.0.1:7070".to_owned(),
                capacity_bytes: 1 << 40,
                fingerprints: Vec::new(),
            },
            lease_id: 7,
            ttl_left_s: Some(5),
            segments: 3,
        }
    }

    #[test]
    fn a_members_address_is_printed_on_its_line_with_control_characters_escaped() {
        // Goal: a member's address comes from etcd as its node wrote it, uninterpreted; one
        // with a newline or an escape sequence printed as it is forged or erased lines of the
        // table. It stays on its line, its control characters escaped.
        let mut member = member("a", [0x12, 0x34, 0x56, 0x78]);
        member.record.address = "10.0.0.1:7070\nb 10.0.0.2:7070\u{1b}[2K".to_owned();
        let line = member_line(&member);
        assert!(!line.chars().any(char::is_control), "{line:?}");
        assert!(line.contains(r"10.0.0.1:7070\nb 10.0.0.2:7070\u{1b}[2K"), "{line}");
        assert!(line.ends_with(" 12345678"), "the key secret tag closes the line: {line}");
    }

    #[test]
    fn members_of_different_key_secrets_are_named_by_group_and_agreeing_ones_say_nothing() {
        // Goal: nodes formatted with different secrets share nothing and nothing else shows
        // it; status names each secret's members, the largest group first, and tells the
        // operator what to do. Members that agree get no line.
        let mut status = ClusterStatus { members: vec![member("a", [1; 4]), member("c", [1; 4])], ..ClusterStatus::default() };
        assert_eq!(key_secret_lines(&status), None);
        status.members.insert(1, member("b", [0x7e; 4]));
        let lines = key_secret_lines(&status).expect("a warning");
        assert!(lines[0].starts_with("WARNING: the members' pools have 2 different key secrets"), "{lines:?}");
        assert_eq!(lines[1], "  key secret 01010101: a c");
        assert_eq!(lines[2], "  key secret 7e7e7e7e: b");
        assert!(lines[3].contains("--key-secret-file"), "{lines:?}");
        assert_eq!(lines.len(), 4);
    }
}
