//! Recorded traffic: the JSONL format the gateway's decision log writes and
//! the simulator replays, and importers for public traces.
