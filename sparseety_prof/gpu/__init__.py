"""The GPU path: the CUPTI injection library's shared-memory ring (`shm_ring`), its records
(`records`), and the correlator that joins kernel timelines to token steps (`correlate`).
Modules here import neither polars nor BCC at import time."""
