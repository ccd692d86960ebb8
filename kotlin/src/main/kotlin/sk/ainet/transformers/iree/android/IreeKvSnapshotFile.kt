package sk.ainet.transformers.iree.android

/**
 * Snapshot files (beside the seed's ABI, in the same `libskainet_iree_kv.so`): an app prefills its
 * shared prefix once, saves the snapshot, and on later launches loads it instead of prefilling.
 *
 * A file is self-describing (format and contract version, the model's fingerprint, geometry,
 * position, rows per layer) and checked whole before use: a file of another model, a truncated
 * or corrupt one throws [IllegalStateException] and the session is untouched. Writes are atomic
 * (a temporary file renamed over [save]'s path). Do not truncate a file while [load] reads it.
 */
object IreeKvSnapshotFile {
    init {
        System.loadLibrary("skainet_iree_kv")
    }

    /** Writes [snapshot] (of [session]) to [path]; returns the bytes written. */
    @JvmStatic
    fun save(session: IreeKvSession, snapshot: IreeKvSession.Snapshot, path: String): Long =
        nativeSave(session.liveHandle(), snapshot.liveHandle(), path)

    /**
     * Loads [path] into a new snapshot of [session] (same model, any layout or device); restore it
     * to continue, as many times as wanted. The session's own state does not change.
     */
    @JvmStatic
    fun load(session: IreeKvSession, path: String): IreeKvSession.Snapshot {
        val h = nativeLoad(session.liveHandle(), path)
        return IreeKvSession.Snapshot(h, nativeSnapshotPosition(h))
    }

    // The raw ABI (public so tests can feed it bad handles).
    @JvmStatic external fun nativeSave(h: Long, snapshot: Long, path: String): Long
    @JvmStatic external fun nativeLoad(h: Long, path: String): Long
    @JvmStatic external fun nativeSnapshotPosition(snapshot: Long): Int
}
