//! The cluster's requests on a connection (`crate::cluster`): a prepared store's keys kept
//! until its commit hands them to the registrar, `LookupCluster` and `FetchRemote`.

use super::{lock, Connection, Shared};
use crate::cluster::ClusterAgent;
use crate::keys::KeySpace;
use crate::protocol::{ClusterLookupReply, ErrorCode, Kind, Reply};

impl Connection {
    /// In a cluster: a prepared store's keys are kept until it commits, then handed to the
    /// registrar (the commit is durable by then); a store that ended otherwise is forgotten.
    pub(super) fn track_stores(&mut self, cluster: &ClusterAgent, space: &KeySpace, kind: Kind, commit_handle: Option<u64>, reply: &Reply) {
        match reply {
            Reply::StorePrepared(prepared) => self.prepared_stores.prepared(prepared.handle, self.holdings.request_keys()),
            Reply::Committed { .. } => {
                if let Some(keys) = commit_handle.and_then(|handle| self.prepared_stores.take(handle)) {
                    cluster.committed(space.model(), keys);
                }
            }
            _ => {}
        }
        if matches!(kind, Kind::Commit | Kind::Release) {
            let holdings = &self.holdings;
            self.prepared_stores.retain(|handle| holdings.holds(handle));
        }
    }

    /// `LookupCluster`: the local prefix as `Lookup` answers it (counted the same way), then,
    /// on a cluster node, what other nodes hold past it (`crate::cluster`, one registry round
    /// trip, bounded by the lookup timeout; no lock is held meanwhile).
    pub(super) fn lookup_cluster(&mut self, shared: &Shared, tokens: &[u32]) -> Reply {
        let Some(space) = self.session.and_then(|session| lock(&shared.sessions).get(&session).map(|record| record.space)) else {
            return Reply::error(ErrorCode::NotAttached, "send Hello (model fingerprint, TP rank and world size) before a lookup");
        };
        let block_tokens = shared.shape.block_tokens;
        space.keys(tokens, block_tokens, &mut self.keys);
        let cached = lock(&shared.store).control.lookup(&self.keys);
        shared.metrics.lookup((tokens.len() / block_tokens.max(1) as usize) as u64, cached as u64);
        let remote = match &shared.cluster {
            Some(cluster) => cluster.beyond(space.model(), &self.keys, cached),
            None => crate::cluster::RemotePart::not_clustered(),
        };
        Reply::ClusterLookup(ClusterLookupReply {
            cached_blocks: cached as u32,
            block_tokens,
            registry: remote.registry,
            remote_blocks: remote.remote_blocks,
            holders: remote.holders,
        })
    }

    /// `FetchRemote`: what other nodes hold past the local prefix is fetched from a holder and
    /// stored here (`crate::cluster`); the client then retrieves it as any cached prefix. Runs
    /// on this connection's thread, without the pool lock across the network.
    pub(super) fn fetch_remote(&mut self, shared: &Shared, tokens: &[u32]) -> Reply {
        let Some(space) = self.session.and_then(|session| lock(&shared.sessions).get(&session).map(|record| record.space)) else {
            return Reply::error(ErrorCode::NotAttached, "send Hello (model fingerprint, TP rank and world size) before a fetch");
        };
        let Some(cluster) = &shared.cluster else {
            return Reply::error(ErrorCode::Unsupported, "this tuttid is not a cluster node (start it with --cluster-etcd)");
        };
        let block_tokens = shared.shape.block_tokens;
        space.keys(tokens, block_tokens, &mut self.keys);
        let cached = lock(&shared.store).control.lookup(&self.keys);
        let stopped = || shared.stop.is_stopped();
        match cluster.fetch(&shared.store, space.model(), &self.keys, cached, &stopped) {
            Ok(fetched) => {
                let cached = lock(&shared.store).control.lookup(&self.keys);
                Reply::Fetched { cached_blocks: cached as u32, fetched_blocks: fetched as u32 }
            }
            Err(message) => Reply::error(ErrorCode::RemoteReadFailed, message),
        }
    }
}
