"""Where the rendezvous state lives: the embedded c10d store (with failover) and an etcd v3 cluster."""
