"""The bandwidth prober: timed probe transfers between workers, EWMA per link, to gossip."""
