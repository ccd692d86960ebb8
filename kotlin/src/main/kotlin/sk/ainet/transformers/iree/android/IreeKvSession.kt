package sk.ainet.transformers.iree.android

/**
 * A stateful KV-cache session over `libskainet_iree_kv.so` (CONTRACT §2, §5): prefill once,
 * snapshot, then chunk and step per utterance. Every native failure throws
 * [IllegalStateException] with the formatted error; the session stays usable afterwards.
 */
class IreeKvSession private constructor(private var handle: Long, val spec: IreeKvSpec) : AutoCloseable {

    /** The caches at one position: no copy, restorable any number of times until [close]d. */
    class Snapshot internal constructor(handle: Long, val position: Int) : AutoCloseable {
        internal var handle: Long = handle
            private set

        override fun close() {
            if (handle != 0L) {
                val h = handle
                handle = 0L
                nativeReleaseSnapshot(h)
            }
        }

        internal fun liveHandle(): Long {
            check(handle != 0L) { "IreeKvSession.Snapshot is closed" }
            return handle
        }
    }

    private fun live(): Long {
        check(handle != 0L) { "IreeKvSession is closed" }
        return handle
    }

    internal fun liveHandle(): Long = live()

    /** Prefills `tokens[0 until n]` from position 0 (tokens may be padded to SEQ); returns the first generated id. */
    fun prefill(tokens: IntArray, n: Int = tokens.size): Int = nativePrefill(live(), tokens, n)

    /** Feeds `tokens[0 until n]`, `1 <= n <= spec.chunk`; returns the next id. */
    fun chunk(tokens: IntArray, n: Int = tokens.size): Int = nativeChunk(live(), tokens, n)

    fun step(token: Int): Int = nativeStep(live(), token)

    fun snapshot(): Snapshot {
        val h = live()
        return Snapshot(nativeSnapshot(h), nativePosition(h))
    }

    fun restore(snapshot: Snapshot) = nativeRestore(live(), snapshot.handle)

    /**
     * Releases the prefill graph once the prefix snapshot exists: later [prefill] calls throw,
     * whatever the layout; with a prefill module of its own (three-archive layout) its module
     * and weights are freed, with one shared module nothing can be.
     */
    fun releasePrefill() = nativeReleasePrefill(live())

    val position: Int get() = nativePosition(live())

    override fun close() {
        if (handle != 0L) {
            val h = handle
            handle = 0L
            nativeDestroy(h)
        }
    }

    companion object {
        init {
            System.loadLibrary("skainet_iree_kv")
        }

        /**
         * Opens the three graphs on `device` (`local-task`, `local-sync`, `vulkan`); [vmfbPrefill] may be null.
         * The embedding table in [irpaWithPast] is named by `embeddingParameter` in a `manifest.json`
         * beside [vmfbWithPast] when there is one, else found by a well-known name or its size.
         * The `.irpa` files are memory-mapped: do not truncate or rewrite them while the session is
         * open (replace them by renaming, then open a new session); a changed file makes calls throw.
         */
        @JvmStatic
        fun open(
            device: String,
            spec: IreeKvSpec,
            vmfbWithPast: String, irpaWithPast: String, fnWithPast: String,
            vmfbChunk: String, irpaChunk: String, fnChunk: String,
            vmfbPrefill: String?, irpaPrefill: String?, fnPrefill: String?,
        ): IreeKvSession = IreeKvSession(
            nativeCreate(
                device, spec, vmfbWithPast, irpaWithPast, fnWithPast,
                vmfbChunk, irpaChunk, fnChunk, vmfbPrefill, irpaPrefill, fnPrefill,
            ),
            spec,
        )

        // The raw ABI of CONTRACT §5 (public so tests can feed it bad handles).
        @JvmStatic external fun nativeCreate(
            device: String, spec: IreeKvSpec,
            vmfbWithPast: String, irpaWithPast: String, fnWithPast: String,
            vmfbChunk: String, irpaChunk: String, fnChunk: String,
            vmfbPrefill: String?, irpaPrefill: String?, fnPrefill: String?,
        ): Long
        @JvmStatic external fun nativePrefill(h: Long, tokens: IntArray, n: Int): Int
        @JvmStatic external fun nativeChunk(h: Long, tokens: IntArray, n: Int): Int
        @JvmStatic external fun nativeStep(h: Long, token: Int): Int
        @JvmStatic external fun nativeSnapshot(h: Long): Long
        @JvmStatic external fun nativeRestore(h: Long, snapshot: Long)
        @JvmStatic external fun nativeReleaseSnapshot(snapshot: Long)
        @JvmStatic external fun nativeReleasePrefill(h: Long)
        @JvmStatic external fun nativePosition(h: Long): Int
        @JvmStatic external fun nativeDestroy(h: Long)
    }
}
