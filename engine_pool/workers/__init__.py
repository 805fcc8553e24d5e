"""Launched workers: the process and its spec (``workers.worker``), its launch options and device groups
(``workers.launch``), the reaper that leads its process group (``workers.reaper``), the watch of its vital
processes (``workers.exits``), the factory that names and places them (``workers.factory``), and workers
as Ray actors (``workers.ray_workers`` places them, ``workers.ray_actor`` runs one)."""
