"""Audio I/O: decoding, resampling, log-mel features, chunking, encoding."""
