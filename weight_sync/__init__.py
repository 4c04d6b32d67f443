"""weight_sync: bucketed broadcast from the learner to engines over SGLang's update protocol. Imports no role."""
