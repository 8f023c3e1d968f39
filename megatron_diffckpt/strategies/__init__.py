"""What happens every iteration, per system, behind one interface
(:class:`~.base.PerIterationStrategy`, which the manager drives):

- :mod:`.base`: the interface, and a base's save protocol (:class:`~.base.BaseSource`,
  :class:`~.base.SaveBase`); takes tensors and callables, imports no megatron;
- :mod:`.lowdiff`: LowDiff, the optimizer step's input captured and written as the differential;
- :mod:`.lowdiff_plus`: LowDiff+, bucket snapshots, the host replica's merges, bases persisted
  from it.

This ``__init__`` imports nothing, so that each loads only what it uses.
"""
