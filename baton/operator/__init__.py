"""The Kubernetes operator for `InferenceService` resources: the CRD schema (`crd`), the typed and
checked spec (`spec`, `validation`), pure builders of the children (`resources`, `pods`), the
idempotent apply (`apply`), status (`status`), the level-triggered reconcile (`reconciler`) and
its kopf triggers (`handlers`). It never imports torch or the engine.
"""
