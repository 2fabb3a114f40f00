//! The registry against a three-member etcd that loses members: one member down, the registry
//! keeps working; every member down, each call answers "unavailable" within its deadline.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tutti_cluster::{ClusterClient, ClusterError, ClusterNode};

/// Three times the longest leader election of the local etcd (election timeout 500 ms,
/// randomised up to twice that; the slowest seen here took 1.5 s on a loaded machine).
const ELECTION_PROOF_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
const ELECTION_PROOF_LEASE_TTL: Duration = Duration::from_secs(5);

#[test]
fn the_registry_survives_the_loss_of_one_etcd_member_of_three() {
    // Goal: with any one member killed (each in turn, the leader among them), lookups,
    // registrations and the member list keep answering, and the node's lease keeps being
    // renewed past its TTL. The request timeout covers a leader election (the members' election
    // timeout is 500 ms, randomised up to 1 s), so that killing the leader costs time, not errors.
    let Some(mut etcd) = start_etcd(3) else { return };
    let mut settings = config(&etcd, "quorum");
    settings.request_timeout = ELECTION_PROOF_REQUEST_TIMEOUT;
    settings.lease_ttl = ELECTION_PROOF_LEASE_TTL;
    let node_a = ClusterNode::join(settings.clone(), record("a")).unwrap();
    let reader = ClusterClient::connect(settings).unwrap();
    // Four more segments registered with each member down: every round's register writes.
    let segments = prompt(11, 16);
    node_a.register(&space(), &segments[..4]).unwrap();
    for member in 0..3 {
        etcd.kill(member).unwrap();
        let started = Instant::now();
        let registered = 4 * (member + 2);
        let sent = node_a.register(&space(), &segments[4 * (member + 1)..registered]).unwrap();
        assert_eq!(sent, 1, "member {member} down: one transaction of four segments");
        assert_eq!(reader.lookup(&space(), &segments).unwrap().prefix_segments(), registered);
        assert_eq!(reader.members().unwrap().nodes, vec![record("a")]);
        eprintln!("member {member} down: register + lookup + members in {:?}", started.elapsed());
        // Longer than the TTL with a member down: renewals must have gone through the others.
        std::thread::sleep(ELECTION_PROOF_LEASE_TTL + Duration::from_millis(500));
        let health = node_a.health();
        assert!(!health.lost && health.since_renewal < ELECTION_PROOF_LEASE_TTL, "{health:?}");
        assert_eq!(reader.members().unwrap().nodes, vec![record("a")]);
        etcd.restart(member).unwrap();
    }
    assert_eq!(reader.lookup(&space(), &segments).unwrap().prefix_segments(), 16);
}

#[test]
fn with_every_etcd_member_down_each_call_is_unavailable_within_its_deadline() {
    // Goal: all three members killed: lookup, members, register and status each return
    // `Unavailable` within the request timeout T (plus scheduling slack), never hang; the
    // compound calls within the bounds lib.rs documents: a join 3 T, a rejoin 4 T (one lease
    // to revoke, then a join), leaving the cluster (drop) T + 1 s.
    let Some(mut etcd) = start_etcd(3) else { return };
    let node_a = ClusterNode::join(config(&etcd, "dark"), record("a")).unwrap();
    let mut node_b = ClusterNode::join(config(&etcd, "dark"), record("b")).unwrap();
    let segments = prompt(12, 4);
    node_a.register(&space(), &segments).unwrap();
    for member in 0..3 {
        etcd.kill(member).unwrap();
    }
    let slack = Duration::from_millis(750);
    let bounded = |what: &str, call: &dyn Fn() -> Result<(), ClusterError>| {
        let started = Instant::now();
        let error = call().expect_err(what);
        let waited = started.elapsed();
        assert!(matches!(error, ClusterError::Unavailable { .. }), "{what}: {error}");
        assert!(waited <= REQUEST_TIMEOUT + slack, "{what} waited {waited:?}");
        eprintln!("{what}: {error} after {waited:?}");
    };
    bounded("lookup", &|| node_a.lookup(&space(), &segments).map(|_| ()));
    bounded("members", &|| node_a.members().map(|_| ()));
    bounded("register", &|| node_a.register(&space(), &segments).map(|_| ()));
    bounded("unregister", &|| node_a.unregister(&space(), &segments).map(|_| ()));
    bounded("status", &|| node_a.client().status().map(|_| ()));
    let fresh = ClusterClient::connect(config(&etcd, "dark")).unwrap();
    bounded("a fresh client's lookup", &|| fresh.lookup(&space(), &segments).map(|_| ()));

    let started = Instant::now();
    let joined = ClusterNode::join(config(&etcd, "dark"), record("c"));
    assert!(matches!(joined, Err(ClusterError::Unavailable { .. })) && started.elapsed() <= REQUEST_TIMEOUT * 3 + slack);
    let started = Instant::now();
    assert!(matches!(node_b.rejoin(), Err(ClusterError::Unavailable { .. })));
    assert!(started.elapsed() <= REQUEST_TIMEOUT * 4 + slack, "rejoin took {:?}", started.elapsed());
    // Its keep-alive stopped and its old lease revoked (or left to expire): the node has no
    // lease, and says so rather than reporting itself joined.
    assert!(node_b.health().lost, "a failed rejoin reports a live lease: {:?}", node_b.health());
    assert!(matches!(node_b.register(&space(), &segments), Err(ClusterError::LeaseLost { .. })));

    // Leaving: the keep-alive is stopped at once, the revoke bounded by the request timeout,
    // the runtime's shutdown by 1 s.
    let started = Instant::now();
    drop(node_a);
    let took = started.elapsed();
    eprintln!("drop with every member down: {took:?}");
    assert!(took <= REQUEST_TIMEOUT + Duration::from_secs(1) + slack, "drop took {took:?}");
}

#[test]
fn a_stalled_etcd_member_costs_no_call_its_deadline() {
    // Goal: a follower that stalls (SIGSTOP: its sockets accept, nothing answers) for longer
    // than the lease TTL: every lookup and registration still succeeds — an attempt stuck on it
    // gives up after a third of the request timeout and the retry goes to another member — and
    // the lease survives, renewed through the others.
    let Some(etcd) = start_etcd(3) else { return };
    // The follower to stall is listed first: the member clients try first.
    let follower = (0..3).find(|&member| !etcd.is_leader(member).unwrap()).unwrap();
    let mut settings = config(&etcd, "stall");
    settings.endpoints.rotate_left(follower);
    let node_a = ClusterNode::join(settings.clone(), record("a")).unwrap();
    let reader = ClusterClient::connect(settings).unwrap();
    let segments = prompt(13, 40);
    node_a.register(&space(), &segments[..1]).unwrap();
    etcd.pause(follower).unwrap();
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for index in 1..segments.len() {
        let call = Instant::now();
        node_a.register(&space(), &segments[index..=index]).unwrap_or_else(|error| panic!("register {index}: {error}"));
        let found = reader.lookup(&space(), &segments).unwrap_or_else(|error| panic!("lookup {index}: {error}"));
        assert_eq!(found.prefix_segments(), index + 1);
        slowest = slowest.max(call.elapsed());
        if started.elapsed() > LEASE_TTL + Duration::from_secs(1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("member {follower} stalled: slowest register + lookup {slowest:?}");
    let health = node_a.health();
    etcd.resume(follower).unwrap();
    assert!(!health.lost && health.since_renewal < LEASE_TTL, "{health:?}");
    assert_eq!(reader.members().unwrap().nodes, vec![record("a")]);
}

#[test]
fn revoking_a_lease_behind_a_stalled_member_gives_up_in_bounded_time() {
    // Goal: `LocalEtcd::revoke_lease` (the tests' way to end a lease behind a node's back)
    // with its only member stalled (SIGSTOP: the socket accepts, nothing answers) returns an
    // error within its bound instead of hanging the test; resumed, the lease is revoked (by the
    // request the stalled member held, or by the next).
    let Some(etcd) = start_etcd(1) else { return };
    let node_a = ClusterNode::join(config(&etcd, "frozen"), record("a")).unwrap();
    let lease_id = node_a.health().lease_id;
    etcd.pause(0).unwrap();
    let etcd_ref = &etcd;
    let (sender, receiver) = std::sync::mpsc::channel();
    let outcome = std::thread::scope(|scope| {
        scope.spawn(move || {
            let started = Instant::now();
            let result = etcd_ref.revoke_lease(lease_id);
            let _ = sender.send((result.map_err(|error| error.to_string()), started.elapsed()));
        });
        let outcome = receiver.recv_timeout(Duration::from_secs(20));
        // Lets a revoke that hung finish, so that the scope ends.
        etcd_ref.resume(0).unwrap();
        outcome
    });
    let (result, took) = outcome.expect("revoke_lease hung behind a stalled member");
    eprintln!("revoke behind a stalled member: {result:?} after {took:?}");
    assert!(result.is_err() && took <= Duration::from_secs(8), "{result:?} after {took:?}");
    match etcd.revoke_lease(lease_id) {
        Ok(()) => {}
        Err(ClusterError::Etcd { source: etcd_client::Error::GRpcStatus(status), .. }) if status.code() == tonic::Code::NotFound => {}
        Err(other) => panic!("revoke after the member resumed: {other}"),
    }
    assert!(node_a.members().unwrap().nodes.is_empty());
}

#[test]
fn a_node_left_after_a_failed_rejoin_revokes_the_lease_it_could_not() {
    // Goal: a rejoin whose revoke of the old lease fails (etcd down: killed, so no request is
    // left in flight to land later) and whose join fails too leaves the node with no
    // keep-alive and the old lease alive once etcd is back (a restart extends every lease).
    // Dropping the node then revokes that lease: its member key and segments go at once.
    // Before, the drop revoked nothing (no keep-alive), leaving them listed until the lease
    // expired (here 10 s).
    let Some(mut etcd) = start_etcd(1) else { return };
    let mut settings = config(&etcd, "unrevoked");
    settings.lease_ttl = Duration::from_secs(10);
    let mut node_a = ClusterNode::join(settings.clone(), record("a")).unwrap();
    let reader = ClusterClient::connect(settings).unwrap();
    let segments = prompt(41, 2);
    node_a.register(&space(), &segments).unwrap();
    etcd.kill(0).unwrap();
    let rejoined = node_a.rejoin();
    assert!(rejoined.is_err(), "rejoined with etcd down: {rejoined:?}");
    etcd.restart(0).unwrap();
    let listed = |reader: &ClusterClient| loop {
        match reader.members() {
            Ok(members) => break members.nodes.len(),
            Err(error @ ClusterError::Unavailable { .. }) => eprintln!("registry unavailable, asking again: {error}"),
            Err(error) => panic!("members: {error}"),
        }
    };
    assert_eq!(listed(&reader), 1, "the old lease did not survive etcd's restart: nothing to show");
    assert_eq!(reader.lookup(&space(), &segments).unwrap().prefix_segments(), 2);
    let started = Instant::now();
    drop(node_a);
    eprintln!("the node was dropped in {:?}", started.elapsed());
    assert_eq!(listed(&reader), 0, "the member key outlived the node, under the lease it could not revoke");
    assert_eq!(reader.lookup(&space(), &segments).unwrap().prefix_segments(), 0);
}
