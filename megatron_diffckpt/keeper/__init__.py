"""The node's keeper: memory that outlives the ranks of a failed attempt.

One process per node (started by ``megatron-diffckpt-launch --keeper-memory MIB``) holds what the
ranks hand it: every differential, LowDiff's newest bases and replicas stepped from them,
LowDiff+'s replica and its merger, and the diff log's writing where the rank leaves it there; a
restarted rank recovers from it before storage, a node lost whole from the next node's keeper.

The modules, by side:

- the protocol: :mod:`.protocol` (the request names), :mod:`.wire` (frames, tensors as files);
- the rank's side: :mod:`.client` (:class:`~.client.KeeperClient`), :mod:`.replica_client`
  (LowDiff+'s hand-overs and every recovery from replicas);
- the keeper process: :mod:`.server` (state, connections, shared memory, ``main``), and the
  services it hosts: :mod:`.bases` (LowDiff's kept bases; its rank-side stager too),
  :mod:`.replicas` (replicas stepped in the keeper), :mod:`.logs` (diff logs it writes; the
  rank's :class:`~.logs.KeeperLogWriter` too), :mod:`.writes` (LowDiff+'s base files);
- the ring: :mod:`.peers` (each keeper copies to the next node's).

This ``__init__`` imports nothing, so that each side loads only what it uses.
"""
