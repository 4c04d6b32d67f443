"""The archiver role (``streamrl archive``): every group of the trajectory stream, with its learner outcome,
in Parquet files under the run directory."""
