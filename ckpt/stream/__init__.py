"""Stage 3, the wire: the frame format and the frame sink/source protocols, with their Kafka and
filesystem implementations."""
