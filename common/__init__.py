"""What every package uses, below all roles: the config library and the shared config section,
process lifecycle, CPU pinning, Prometheus exposition, finding the run's Redis. Imports no package of streamrl."""
