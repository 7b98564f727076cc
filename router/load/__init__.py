"""The load the router measures: arrivals, latencies, prefill times and recent prefill work,
read by placement's load bound and by the P:D controller."""
