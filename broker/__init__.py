"""broker: everything about Redis. The trajectory record and codec, producer, consumer, dead letters, the policy
version, metrics, and the embedded server. Imports no role package."""
