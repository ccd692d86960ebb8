package sk.ainet.transformers.iree.android

import java.util.concurrent.atomic.AtomicLong

/**
 * A model opened from an export directory (`skainet-kv export --target ...`): the graphs, the
 * tokenizer (`tokenizer.gguf`), the chat template and the stop ids, all read from what the
 * export wrote. One engine holds one copy of the weights and one session; its conversations
 * ([createConversation]) share it and answer one after the other.
 *
 * Every failure throws [EngineException] (its [EngineException.kind] says which); a closed
 * engine refuses every call, and so do its conversations.
 */
class Engine private constructor(handle: Long) : AutoCloseable {
    private val handle = AtomicLong(handle)

    /** The model's name as the export recorded it. */
    val name: String

    /** How the model writes tool calls (`functiongemma`, `hermes`), or null: text only. */
    val toolFormat: String?

    val vocabSize: Int

    /** The longest conversation, in tokens (catalog, turns and answers together). */
    val maxPositions: Int

    /** The ids that end an answer (EOS, end of turn, ...), from the tokenizer. */
    val stopIds: IntArray

    init {
        val info = nativeInfo(handle)
        name = info[0]
        toolFormat = info[1].ifEmpty { null }
        vocabSize = info[2].toInt()
        maxPositions = info[3].toInt()
        stopIds = info[4].split(',').filter { it.isNotEmpty() }.map { it.toInt() }.toIntArray()
    }

    internal fun liveHandle(): Long {
        val h = handle.get()
        if (h == 0L) throw EngineException("[closed] Engine is closed")
        return h
    }

    /**
     * A conversation with [config]'s system prompt and tools. Its catalog (the system turn with
     * the tool declarations) is prefilled once per engine and reused by every conversation with
     * the same system prompt and tools, or loaded from [ConversationConfig.catalogFile].
     */
    fun createConversation(config: ConversationConfig = ConversationConfig()): Conversation {
        val s = config.sampling
        val h = Conversation.nativeCreate(
            liveHandle(), config.systemPrompt, config.toolsJson, config.toolChoice, config.maxNewTokens,
            config.constrained, s.temperature, s.topK, s.topP, s.minP, s.repetitionPenalty, s.seed,
            config.catalogFile,
        )
        return Conversation(h, this)
    }

    /**
     * Starts recording the device's dispatches into the file [path] until [endDeviceProfile]:
     * IREE's profile bundle, each dispatch's GPU timestamps on `vulkan` (the CPU devices record
     * their threads' spans). Pull it from the device and read it with `iree-profile dispatch`
     * or `scripts/h200/step-timeline.py` (docs/android.md). Recording adds work to every
     * dispatch: time the app without it. Waits for an answer in progress.
     */
    fun beginDeviceProfile(path: String) = nativeBeginDeviceProfile(liveHandle(), path)

    /** Ends [beginDeviceProfile]'s recording and completes its file; nothing if none was begun. */
    fun endDeviceProfile() = nativeEndDeviceProfile(liveHandle())

    /** Frees the weights, the session and every catalog. Idempotent. */
    override fun close() {
        val h = handle.getAndSet(0L)
        if (h != 0L) nativeClose(h)
    }

    companion object {
        init {
            System.loadLibrary("skainet_iree_kv")
        }

        /** Opens the export in [exportDir] on [device] (`local-task`, `local-sync`, `vulkan`). */
        @JvmStatic
        @JvmOverloads
        fun open(exportDir: String, device: String = "local-task"): Engine = Engine(nativeOpen(exportDir, device))

        // The raw ABI (public: internal names are mangled on the JVM; tests feed it bad handles).
        @JvmStatic external fun nativeOpen(dir: String, device: String): Long
        @JvmStatic external fun nativeInfo(h: Long): Array<String>
        @JvmStatic external fun nativeClose(h: Long)
        @JvmStatic external fun nativeBeginDeviceProfile(h: Long, path: String)
        @JvmStatic external fun nativeEndDeviceProfile(h: Long)
    }
}

/**
 * A failure of [Engine] or [Conversation], with the native cause in its message. [kind] is one
 * of `closed`, `busy`, `bad_argument`, `bad_handle`, `catalog` (a catalog file of another
 * catalog or model, or a damaged one), `model` (the export lacks something), `context_full`,
 * `io`, `constraint`, `backend`, `jni`, `internal`.
 */
class EngineException(message: String) : IllegalStateException(message) {
    val kind: String = Regex("^\\[([a-z_]+)]").find(message)?.groupValues?.get(1) ?: "internal"
}
