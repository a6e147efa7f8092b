"""The checkpoints wing: which steps of a job are committed where, and who is told.

* `catalog` — landings in, committed steps out (a step commits at a tier once every
  rank's shard is there with its checksum), retention, buddies;
* `publisher` — every node of a job gets the job's catalog (its committed steps and
  where their copies are).
"""
