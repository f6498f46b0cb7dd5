"""Tools every role uses and none owns: the retry backoff, the heap's collector
settings, pickling, logging set-up, how redisdask starts its own processes, sizes
(``"4GB"``, memory limits), and packages whose names are imported at first use
(``lazy``).  They import nothing else of redisdask's."""
