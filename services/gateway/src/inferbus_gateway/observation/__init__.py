"""What the gateway records about the requests it answers: access logs, audit
batches, payload capture, drift, sampling and SLO metrics."""
