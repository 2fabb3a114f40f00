//! How a node or client talks to the registry: settings only, no etcd (so tuttid checks them at
//! start, and builds that leave etcd out still name them).

use std::time::Duration;

use crate::error::{ClusterError, Result};
use crate::layout::{ANSWER_OVERHEAD_BYTES, RANGE_OVERHEAD_BYTES, SEGMENT_ENTRY_BYTES_MAX};
use crate::names::ClusterId;
use crate::segments::SegmentBlocks;

/// etcd's default `--max-txn-ops`: the most operations one transaction may carry.
pub const ETCD_TXN_OPS_DEFAULT: usize = 128;

/// The most bytes one answer from etcd may have: the client refuses a longer one as it decodes
/// it (gRPC's default, 4 MiB, set explicitly on every key-value client). etcd itself accepts
/// values up to its `--max-request-bytes` (1.5 MiB by default), so a few foreign entries under
/// one prefix can outgrow it: every read is sized so that sound entries fit
/// ([`ClusterConfig::validate`], the scans' page sizes), and one that still meets a longer
/// answer reads less at a time and skips, counted, an entry too large to read alone.
pub const RESPONSE_BYTES_MAX: usize = 4 << 20;

/// How a node or client talks to the registry.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://host:port`), every member of the etcd cluster. [`ClusterConfig::new`]
    /// writes `host:port` (no scheme, as etcd-client takes it) and a scheme in upper case as
    /// `http://host:port`; set directly, an endpoint is used as written.
    pub endpoints: Vec<String>,
    pub cluster: ClusterId,
    /// Blocks per segment; the same on every node of the cluster.
    pub segment_blocks: SegmentBlocks,
    /// The longest any call waits for etcd, retries included (then `Unavailable`). To ride out
    /// the loss of etcd's leader without an error it must exceed twice etcd's election timeout
    /// (default 1 s: an election takes one to two timeouts).
    pub request_timeout: Duration,
    /// A member's lease: it and its segments vanish this long after its last renewal. Whole
    /// seconds (etcd's unit); renewed every third of it.
    pub lease_ttl: Duration,
    /// Operations per etcd transaction, 2..=128: etcd's `--max-txn-ops` must be at least this
    /// (etcd refuses a longer transaction). A lookup of more segments than this costs one round
    /// trip per this many (stopping at the first miss); a registration or unregistration one
    /// per this many less one (each transaction puts the member key too).
    pub txn_ops_max: usize,
    /// Most holders a lookup returns per segment (the rest exist but are not listed). With
    /// `txn_ops_max`, bounded by [`RESPONSE_BYTES_MAX`]: holders × operations ≤ ~8,000.
    /// Which ones: each segment's holders are one range read in key order, whose last part is
    /// the node id, so always those of the lowest node ids (byte order), whatever the reader.
    /// A segment with more holders than this sends every reader to the same ones (the others
    /// never serve it, and a dead low id is tried until its lease expires), and a holder past
    /// the limit in one segment's list ends its run there (`Lookup::holder_prefixes`). Set it
    /// above the most replicas one segment may have (at most every node of the cluster);
    /// tuttid keeps the default (no flag sets it).
    pub holders_max: usize,
}

impl ClusterConfig {
    /// The defaults: 3 s per request (etcd's default election timeout is 1 s), a 10 s lease, 128 operations per transaction, 16 holders.
    /// Endpoints are written as `http://host:port` (`normalize_endpoint`).
    pub fn new(endpoints: Vec<String>, cluster: ClusterId, segment_blocks: SegmentBlocks) -> ClusterConfig {
        ClusterConfig {
            endpoints: endpoints.into_iter().map(normalize_endpoint).collect(),
            cluster,
            segment_blocks,
            request_timeout: Duration::from_secs(3),
            lease_ttl: Duration::from_secs(10),
            txn_ops_max: ETCD_TXN_OPS_DEFAULT,
            holders_max: 16,
        }
    }

    /// Checks every setting, the lease's included (done by `ClusterNode::join`): for a node
    /// that wants to refuse bad settings at start rather than at its join.
    pub fn validate(&self) -> Result<()> {
        self.validate_connection()?;
        self.validate_lease()
    }

    /// Checks the settings a client that holds no lease uses (done by
    /// `ClusterClient::connect`): the request timeout's range, transactions, answers. The lease
    /// TTL is not looked at: a lookup client or `tutti cluster status` renews nothing, so its
    /// request timeout is not bound by a lease.
    pub fn validate_connection(&self) -> Result<()> {
        let bad = |text: String| Err(ClusterError::InvalidSetting(text));
        if self.endpoints.is_empty() {
            return bad("no etcd endpoint given".into());
        }
        for endpoint in &self.endpoints {
            check_endpoint(endpoint).map_err(ClusterError::InvalidSetting)?;
        }
        if !(Duration::from_millis(10)..=Duration::from_secs(60)).contains(&self.request_timeout) {
            return bad(format!("request timeout {:?} is outside 10 ms..=60 s", self.request_timeout));
        }
        // A node's guarded write puts its member key besides its segments (the fence,
        // `ClusterNode::guarded`): one operation leaves no room for a segment.
        if !(2..=ETCD_TXN_OPS_DEFAULT).contains(&self.txn_ops_max) {
            return bad(format!(
                "{} operations per transaction is outside 2..={ETCD_TXN_OPS_DEFAULT} (a node's write carries its member key's put \
                 besides at least one segment; etcd's --max-txn-ops must be at least this)",
                self.txn_ops_max
            ));
        }
        if !(1..=1024).contains(&self.holders_max) {
            return bad(format!("{} holders per segment is outside 1..=1024", self.holders_max));
        }
        // A lookup's one transaction reads `holders_max` entries for each of `txn_ops_max`
        // segments: sound entries must fit one answer, so that only foreign ones can make it
        // longer (defaults: 16 × 128 × 512 B = 1 MiB of 4 MiB).
        let lookup_bytes =
            self.holders_max * self.txn_ops_max * SEGMENT_ENTRY_BYTES_MAX + self.txn_ops_max * RANGE_OVERHEAD_BYTES + ANSWER_OVERHEAD_BYTES;
        if lookup_bytes > RESPONSE_BYTES_MAX {
            return bad(format!(
                "{} holders × {} segments per transaction may answer {lookup_bytes} bytes, over the {RESPONSE_BYTES_MAX} an answer may have",
                self.holders_max, self.txn_ops_max
            ));
        }
        Ok(())
    }

    /// Checks the lease a node keeps: its TTL, and a request timeout that lets a renewal land
    /// before the lease runs out.
    pub fn validate_lease(&self) -> Result<()> {
        let bad = |text: String| Err(ClusterError::InvalidSetting(text));
        let ttl_s = self.lease_ttl.as_secs();
        if self.lease_ttl.subsec_nanos() != 0 || !(2..=3600).contains(&ttl_s) {
            return bad(format!("lease TTL {:?} is not a whole number of seconds in 2..=3600", self.lease_ttl));
        }
        // A renewal is sent every TTL/3 and may take the whole request timeout: it must still
        // land before the lease runs out.
        if self.request_timeout * 3 > self.lease_ttl * 2 {
            return bad(format!(
                "request timeout {:?} leaves no room to renew a {ttl_s} s lease (at most 2/3 of the TTL)",
                self.request_timeout
            ));
        }
        Ok(())
    }
}

/// `endpoint` with its scheme as etcd-client matches it (`http://`, in lower case): `HTTP://`
/// in any case is written so, and `HOST:PORT` without a scheme is given `http://` (as
/// etcd-client itself does without TLS); anything else is left for [`check_endpoint`] to name.
pub fn normalize_endpoint(endpoint: String) -> String {
    match endpoint.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => format!("http://{rest}"),
        Some(_) => endpoint,
        None if endpoint.is_empty() => endpoint,
        None => format!("http://{endpoint}"),
    }
}

/// An etcd client URL this client can use: `http://HOST:PORT` (the scheme in any case, or left
/// out: etcd-client takes `HOST:PORT` as `http://`), the port in 1..=65535 (etcd's gRPC without
/// TLS; the port is not left to a default, which would be 80, where etcd does not listen).
/// Otherwise a sentence naming it.
fn check_endpoint(endpoint: &str) -> std::result::Result<(), String> {
    let refuse = |why: &str| Err(format!("etcd endpoint '{endpoint}': {why}; accepted: [http://]HOST:PORT (e.g. http://127.0.0.1:2379)"));
    let authority = match endpoint.split_once("://") {
        Some((scheme, authority)) if scheme.eq_ignore_ascii_case("http") => authority,
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => return refuse("https needs TLS, which this client does not speak"),
        Some((scheme, _)) => return refuse(&format!("scheme '{scheme}' is not http")),
        None => endpoint,
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.contains(['/', '@', '?', '#']) || authority.chars().any(char::is_whitespace) {
        return refuse("a URL of etcd has a host and a port only (no path, user or query)");
    }
    let Some((host, port)) = authority.rsplit_once(':') else { return refuse("no port") };
    let bracketed = host.starts_with('[') || host.ends_with(']');
    if host.is_empty()
        || host == "[]"
        || (bracketed && !(host.starts_with('[') && host.ends_with(']')))
        || (!bracketed && host.contains(':'))
    {
        return refuse("no host (an IPv6 address goes in brackets: http://[::1]:2379)");
    }
    match port.parse::<u16>() {
        Ok(1..) => Ok(()),
        _ => refuse(&format!("port '{port}' is not in 1..=65535")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_of_sound_entries_must_fit_one_answer() {
        // Goal: `validate` refuses holders × operations per transaction whose sound entries
        // alone could outgrow an answer (1,024 holders × 128 segments × 512 B = 64 MiB), and
        // accepts the defaults and the same holders over fewer operations.
        let mut config =
            ClusterConfig::new(vec!["http://127.0.0.1:2379".into()], ClusterId::new("fleet").unwrap(), SegmentBlocks::new(32).unwrap());
        assert!(config.validate().is_ok());
        config.holders_max = 1024;
        match config.validate() {
            Err(ClusterError::InvalidSetting(text)) => assert!(text.contains("1024 holders × 128 segments"), "{text}"),
            other => panic!("{other:?}"),
        }
        config.txn_ops_max = 7;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn a_transaction_must_carry_a_segment_besides_the_member_key() {
        // Goal: every guarded write of a node puts its member key besides its segments (the
        // fence), so a transaction carries two operations at least: 1 was accepted, and a
        // server whose `--max-txn-ops` it followed refused every registration. `validate`
        // refuses fewer than two, and says why.
        let mut config =
            ClusterConfig::new(vec!["http://127.0.0.1:2379".into()], ClusterId::new("fleet").unwrap(), SegmentBlocks::new(32).unwrap());
        config.txn_ops_max = 1;
        match config.validate() {
            Err(ClusterError::InvalidSetting(text)) => assert!(text.contains("outside 2..=128") && text.contains("member key"), "{text}"),
            other => panic!("{other:?}"),
        }
        config.txn_ops_max = 2;
        assert!(config.validate().is_ok());
        config.txn_ops_max = 129;
        assert!(config.validate().is_err());
    }

    #[test]
    fn endpoints_must_be_http_urls_with_a_port() {
        // Goal: what no etcd can be reached at is an invalid setting, named, not a failed
        // connection; a port past 65535 is not read as no port (80).
        for good in ["http://127.0.0.1:2379", "http://etcd-0.local:2379/", "http://[::1]:2379"] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "http://",
            "https://127.0.0.1:2379",
            "http://127.0.0.1:99999",
            "http://127.0.0.1:0",
            "http://127.0.0.1",
            "http://:2379",
            "http://::1:2379",
            "http://h:1/v3",
            "HTTPS://127.0.0.1:2379",
            "ftp://127.0.0.1:2379",
            "127.0.0.1",
            ":2379",
        ] {
            let error = check_endpoint(bad).unwrap_err();
            assert!(error.starts_with(&format!("etcd endpoint '{bad}': ")), "{error}");
        }
        let mut config = ClusterConfig::new(vec![], ClusterId::new("fleet").unwrap(), SegmentBlocks::new(32).unwrap());
        assert!(matches!(config.validate_connection(), Err(ClusterError::InvalidSetting(_))));
        // etcd-client takes HOST:PORT without a scheme as http:// (its build_endpoint), so that
        // is accepted too, as is the scheme in any case; new() writes both as http://.
        for good in ["127.0.0.1:2379", "etcd-0.local:2379", "[::1]:2379", "HTTP://127.0.0.1:2379", "Http://[::1]:2379/"] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        let given = vec!["127.0.0.1:2379".to_string(), "HTTP://etcd-0:2379".to_string(), "http://etcd-1:2379".to_string()];
        let normalized = ClusterConfig::new(given, ClusterId::new("fleet").unwrap(), SegmentBlocks::new(32).unwrap());
        assert_eq!(normalized.endpoints, ["http://127.0.0.1:2379", "http://etcd-0:2379", "http://etcd-1:2379"]);
        config.endpoints = vec!["http://127.0.0.1:2379".into(), "http://127.0.0.1:99999".into()];
        assert!(matches!(config.validate_connection(), Err(ClusterError::InvalidSetting(text)) if text.contains("99999")));
    }
}
