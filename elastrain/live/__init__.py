"""Live reconfiguration (``elastrain-run --live true``): a membership change without a process restart.

The agent completes the new round and tells its running workers through the control channel
(:class:`elastrain.control.RegroupChannel`). A worker that uses :class:`elastrain.session.Session`
then gives up the step in flight, leaves the old process group (:mod:`elastrain.live.group`), joins the
new round's group, and the members agree on one state (:mod:`elastrain.live.agreement`): the last
step every member with state in memory completed, broadcast from a member at that step
(:mod:`elastrain.live.transfer`), so that every rank holds bit-identical model, optimizer and train
state; a member that applied a later step rolls back. Members with no state in memory (a restarted
node, a joining one) receive it the same way; only when no member has state is the checkpoint read.
"""
