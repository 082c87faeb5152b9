"""Engine bookkeeping: requests, the paged-KV block pool and manager, the scheduler, outputs."""
