"""Workers (threads or processes), bounded queues, ordering, error transport, shutdown.

The engine runs *any* work; it knows nothing of images or storage. Files, in lifecycle order:

* ``job.py``     what a worker does with one task: fetch a batch (map-style indices or the next
  items of an iterable), collate it, isolate global RNGs, skip failing samples. Picklable.
* ``worker_copy.py`` the dataset object a thread worker reads: its own copy (small plain
  containers included), as each torch worker process has.
* ``worker_info.py`` ``torch.utils.data.get_worker_info()`` answered per thread worker (a patch
  of torch), and whether a worker consulted it.
* ``seed_view.py`` ``torch.initial_seed()`` answered per worker (``base_seed + worker_id``, as in
  torch's worker processes) despite shared generators and per-sample isolation (a patch of torch).
* ``isolated_fetch.py`` the job's fetch under global-RNG isolation (probe, watch, reseed).
* ``isolate.py`` global-RNG isolation for datasets seen to draw from ``random``/``np.random``/
  ``torch``: probe, watch (generator fingerprints), reseed per sample or batch, one lock.
* ``worker_rng.py`` a thread worker's own global generators when its ``worker_init_fn`` seeds
  them, or when it reads an ``IterableDataset`` (swapped in around its fetches; an iterable's
  probed each epoch, then watched until it draws), as a torch worker process has.
* ``base.py``    the task/result records and the worker loop shared by every engine.
* ``failure.py`` error transport: an exception captured in a worker is raised in the consumer
  as the original (threads) or its equal (processes: type, args, attributes, chain) with a note
  naming the worker, the stage and the sample indices; ``kuat.WorkerError`` for what cannot
  cross a process boundary.
* ``inline.py``  ``num_workers=0``: runs each task in the calling thread when its result is asked.
* ``thread.py``  N daemon threads, one task queue each, one result queue.
* ``process.py`` N processes, one pipe each; batches come back through ``shm.py``.
* ``shm.py``     reused shared-memory slots without a name (``memfd``, passed over the pipe), so
  no death leaves anything in ``/dev/shm``; the encode/decode of a batch's tensors into a slot.

Every engine has the same consumer-side interface: ``submit(worker_id, task)``,
``get(timeout_s) -> Result`` (raises ``queue.Empty`` on time-out), ``close()`` (idempotent, and
prompt: it never waits for a worker busy in the dataset). The thread engine also gives the
first two as its queues' own methods (``calls()``: what the loader's per-batch loop calls).
The loader (``kuat/loader/``) owns ordering, prefetch bounds, epochs and state.
"""
