"""The skeleton both worker roles share: engine loop, KV events, health, stats, early ends."""
