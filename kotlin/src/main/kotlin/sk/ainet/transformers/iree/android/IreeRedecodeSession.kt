package sk.ainet.transformers.iree.android

/**
 * The redecode graph `f(tokens [1, SEQ]) -> [SEQ]` over `libskainet_iree_redecode.so`
 * (CONTRACT §3, §5). [step] takes exactly SEQ ids and returns the next id at every position, or
 * null when the module's result breaks that contract.
 */
class IreeRedecodeSession private constructor(private var handle: Long, val seq: Int) : AutoCloseable {

    constructor(device: String, vmfbPath: String, irpaPath: String, functionName: String, seq: Int) :
        this(nativeCreate(device, vmfbPath, irpaPath, functionName), seq)

    /** As the primary constructor, with [groups] workers for the `local-task` executor. */
    constructor(device: String, vmfbPath: String, irpaPath: String, functionName: String, seq: Int, groups: Int) :
        this(nativeCreateWithTopology(device, vmfbPath, irpaPath, functionName, groups), seq)

    fun step(tokenIds: IntArray): IntArray? {
        check(handle != 0L) { "IreeRedecodeSession is closed" }
        return nativeStep(handle, tokenIds)
    }

    /** The seed's `IreeRedecodeDecoder.generate`: pad to SEQ, call, read one position, append, repeat. */
    fun generate(promptIds: IntArray, eosTokenId: Int, maxNewTokens: Int): IntArray {
        require(promptIds.isNotEmpty() && promptIds.size < seq) { "prompt of ${promptIds.size} ids does not fit SEQ $seq" }
        val buffer = IntArray(seq)
        promptIds.copyInto(buffer)
        var len = promptIds.size
        val out = ArrayList<Int>()
        while (out.size < maxNewTokens && len < seq) {
            val next = step(buffer) ?: throw IllegalStateException("the module's result breaks the redecode contract")
            val token = next[len - 1]
            if (token == eosTokenId) break
            out.add(token)
            buffer[len++] = token
        }
        return out.toIntArray()
    }

    override fun close() {
        if (handle != 0L) {
            val h = handle
            handle = 0L
            nativeDestroy(h)
        }
    }

    companion object {
        init {
            System.loadLibrary("skainet_iree_redecode")
        }

        @JvmStatic external fun nativeCreate(device: String, vmfbPath: String, irpaPath: String, functionName: String): Long
        @JvmStatic external fun nativeCreateWithTopology(device: String, vmfb: String, irpa: String, fn: String, groups: Int): Long
        @JvmStatic external fun nativeStep(h: Long, tokenIds: IntArray): IntArray?
        @JvmStatic external fun nativeDestroy(h: Long)
    }
}
