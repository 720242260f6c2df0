"""``actorproxy run --workers N``: N worker processes serve one port; each session stays with one worker.

- :mod:`.routing`: which worker owns a request's session (``crc32`` of its id, modulo N);
- :mod:`.handoff`: a connection moved to its owner with ``SCM_RIGHTS``, the bytes read with it;
- :mod:`.fanout` and :mod:`.merge`: the trainer's and operator's routes asked of every worker, merged;
  :mod:`.holds`: a worker's part of a drain across workers, held until the merged reply went out;
- :mod:`.worker`: one worker (a whole proxy runtime, its own SQLite file); :mod:`.child` its process;
- :mod:`.supervisor`: starts the workers, restarts one that exits, passes SIGTERM/SIGINT on.

docs/workers.md describes the whole.
"""
