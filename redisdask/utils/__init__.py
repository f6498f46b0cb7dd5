"""Tools every role uses and none owns: the retry backoff, the heap's collector
settings, pickling, logging set-up, how redisdask starts its own processes, and sizes
(``"4GB"``, memory limits).  They import nothing else of redisdask's."""
