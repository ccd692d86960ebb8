package sk.ainet.transformers.iree.android

import java.util.concurrent.atomic.AtomicLong

/** Receives the answer's text as it is decoded, on the thread that called [Conversation.send]. */
fun interface TextListener {
    fun onText(piece: String)
}

/** Sampling settings; the default is greedy. A temperature above 0 needs an export with top-k results. */
data class SamplingOptions(
    val temperature: Float = 0f,
    /** 0 = every candidate the export hands over. */
    val topK: Int = 0,
    val topP: Float = 1f,
    val minP: Float = 0f,
    val repetitionPenalty: Float = 1f,
    val seed: Long = 0L,
)

/**
 * What a conversation is made of. [toolsJson] is a JSON list of
 * `{"type": "function", "function": {"name", "description", "parameters": JSON Schema}}`.
 * [toolChoice] is `auto`, `required`, `none` or a tool's name. [constrained] decodes under the
 * tools' grammar, so calls always parse and validate. [catalogFile]: where the catalog
 * snapshot is kept across app starts (loaded when it exists, else written after the prefill);
 * a file of another system prompt, tool list or model throws ([EngineException.kind] `catalog`).
 */
data class ConversationConfig(
    val systemPrompt: String? = null,
    val toolsJson: String? = null,
    val toolChoice: String = "auto",
    val maxNewTokens: Int = 96,
    val constrained: Boolean = true,
    val sampling: SamplingOptions = SamplingOptions(),
    val catalogFile: String? = null,
)

/** A tool call that parsed and validated against the catalog; [argumentsJson] is a JSON object. */
data class ToolCall(val name: String, val argumentsJson: String)

enum class Finish { STOP, MAX_TOKENS, CANCELLED, CALLBACK }

/** How a conversation's catalog was obtained. */
enum class CatalogSource { PREFILLED, MEMORY, FILE }

/** One answer: the text outside calls, the calls, and why it ended. */
data class Reply(
    val text: String,
    val toolCalls: List<ToolCall>,
    /** Calls that did not parse or validate, and why (none when constrained). */
    val invalidToolCalls: List<String>,
    val finish: Finish,
    val tokens: Int,
    val requestTokens: Int,
    val elapsedMs: Double,
) {
    val cancelled: Boolean get() = finish == Finish.CANCELLED

    internal companion object {
        /** The native layout: text, finish, tokens, requestTokens, elapsedMs, nCalls, (name, args)*, nInvalid, reason*. */
        fun of(a: Array<String>): Reply {
            val nCalls = a[5].toInt()
            val calls = (0 until nCalls).map { ToolCall(a[6 + 2 * it], a[7 + 2 * it]) }
            val at = 6 + 2 * nCalls
            val invalid = (0 until a[at].toInt()).map { a[at + 1 + it] }
            return Reply(a[0], calls, invalid, Finish.valueOf(a[1].uppercase()), a[2].toInt(), a[3].toInt(), a[4].toDouble())
        }
    }
}

/**
 * A conversation: a system prompt, tools and the turns so far. [send] answers one message at a
 * time; [cancel] stops it from any thread. A cancelled or failed send adds nothing to the
 * conversation, which stays usable. Closed (or of a closed [Engine]), it refuses every call.
 */
class Conversation internal constructor(handle: Long, val engine: Engine) : AutoCloseable {
    private val handle = AtomicLong(handle)

    val catalogSource: CatalogSource = CatalogSource.values()[nativeCatalogSource(handle)]

    private fun live(): Long {
        val h = handle.get()
        if (h == 0L) throw EngineException("[closed] Conversation is closed")
        return h
    }

    /**
     * Answers [text]: streams the answer's text to [listener] as it is decoded and returns it
     * parsed into text and tool calls. Blocks while another conversation of the engine answers.
     */
    @JvmOverloads
    fun send(text: String, listener: TextListener? = null): Reply = Reply.of(nativeSend(live(), text, listener))

    /** Stops the send running now (it returns with [Finish.CANCELLED]); does nothing when none runs. */
    fun cancel() = nativeCancel(live())

    /** Writes the catalog snapshot to [path] (atomically); returns the bytes written. */
    fun saveCatalog(path: String): Long = nativeSaveCatalog(live(), path)

    /** Cancels a send in progress and frees the conversation. Idempotent. */
    override fun close() {
        val h = handle.getAndSet(0L)
        if (h != 0L) nativeClose(h)
    }

    companion object {
        init {
            System.loadLibrary("skainet_iree_kv")
        }

        // The raw ABI (public: internal names are mangled on the JVM; tests feed it bad handles).
        @JvmStatic external fun nativeCreate(
            engine: Long, system: String?, toolsJson: String?, toolChoice: String, maxNewTokens: Int,
            constrained: Boolean, temperature: Float, topK: Int, topP: Float, minP: Float,
            repetitionPenalty: Float, seed: Long, catalogFile: String?,
        ): Long
        @JvmStatic external fun nativeCatalogSource(h: Long): Int
        @JvmStatic external fun nativeSend(h: Long, text: String, listener: TextListener?): Array<String>
        @JvmStatic external fun nativeCancel(h: Long)
        @JvmStatic external fun nativeSaveCatalog(h: Long, path: String): Long
        @JvmStatic external fun nativeClose(h: Long)
    }
}
