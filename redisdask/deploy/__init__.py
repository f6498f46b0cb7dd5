"""Starting a cluster: ``LocalCluster`` (a scheduler and workers as processes or threads of
this machine) and the embedded Redis it starts when no URL is given."""
