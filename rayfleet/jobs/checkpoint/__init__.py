"""Flash checkpoints: snapshot to node-local shared memory and persist in the background
(``flash``), restore from shared memory (``restore``), and the train loop's hook (``hook``)."""
