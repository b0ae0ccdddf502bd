"""``kuat.DataLoader``, a drop-in for ``torch.utils.data.DataLoader``: the map of the package.

Data flow: sampler -> engine (inline, threads, processes) -> device -> user. One
module answers each question about the loader:

============================================  ===================================================
question                                      module
============================================  ===================================================
what the loader looks like to torch and to    :mod:`kuat.loader.dataloader` (the face: signature,
frameworks (arguments, attributes, ``len``)   public attributes, methods that delegate, pickling)
are the arguments valid; what can the         :mod:`kuat.loader._options` (torch's checks in
source do                                     torch's order; ``LoaderOptions``, ``SourceTraits``)
where is the epoch order decided              :mod:`kuat.loader._epoch` (``plan_epoch``: epoch,
                                              seeds, keys, skip -> an ``EpochPlan``; the
                                              permutation itself: ``kuat.sampling``)
where is rank resolved                        :mod:`kuat.distributed` (the only place; the
                                              loader applies it in ``_epoch.apply_distributed``)
where is ``state_dict`` built                 :mod:`kuat.loader._state` (``Position``,
                                              ``Pending``, ``state_dict``/``load_state_dict``)
can a state continue on another layout        :mod:`kuat.loader._elastic` (global position,
(world, batch size, workers)                  layout fingerprint; what raises)
where do batches cross threads                :mod:`kuat.loader._iterator` (dispatch to workers,
                                              order, device copy) over :mod:`kuat.engine`; the
                                              sampler's pace: :mod:`kuat.loader._paced`
which engine runs an epoch                    :mod:`kuat.loader._workers` (``WorkerPool``,
                                              ``Lease``; persistent workers)
what adapts during an epoch                   :mod:`kuat.loader._adaptive` (prefetch depth,
                                              inline fetching, threads -> processes, first-
                                              batch split)
which worker type and count (``worker_type=  :mod:`kuat.loader._auto` (``WorkerChoice``: the
None``, ``num_workers="auto"``)               first batches measured, the GIL probe, the rule)
what the iterator is handed                   :mod:`kuat.loader._plan` (``EpochPlan``,
                                              ``EpochObserver`` for framework integrations)
where input time went                         :mod:`kuat.loader._stats` (``stats()``)
what the loader warns about once              :mod:`kuat.loader._notices`
============================================  ===================================================

Where seeds come from: :mod:`kuat.rng` (every derivation and salt). What a source may provide:
:mod:`kuat.sources.protocol`. Behaviour in depth: ``docs/loader.md``.

Dependencies point one way: the face imports the planner, state, workers and iterator; the
iterator imports neither the face nor any framework integration (``tests/test_layering.py``).
"""

from kuat.loader.dataloader import DataLoader

__all__ = ["DataLoader"]
